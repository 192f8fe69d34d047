"""``parallelize`` keeps its metadata per model, frees what it replaced, generates, and refuses
bad input with typed errors (2 gloo ranks).

* A replaced ``nn.Linear`` is freed once ``parallelize`` returns, and dropping the model frees
  it: no DeepShard bookkeeping holds either (checked with ``weakref``).
* Two models with different head counts in one process: parallelizing the second leaves the
  first one's plan, shards and logits unchanged.
* ``parallelize`` + ``torch.no_grad()`` greedy generation (with the KV cache) gives the
  unsharded model's tokens.
* Head-count attributes are halved on TP=2 only in the subtree holding split layers, and an
  attention that reshapes with them still matches the dense one; placements say ``Shard(dim)``.
* A plan for another TP size, a conflicting ``autotp_size``, a second ``parallelize`` of the
  same model and a column split of a non-Linear are ``ConfigError``s naming the key.
"""

from __future__ import annotations

import copy
import gc
import weakref
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from deepshard.autotp import LayerPlan, Style, TPPlan, make_plan, parallelize, plan_of, tp_state
from deepshard.interface import Topology
from deepshard.interface.config import TensorParallelConfig
from deepshard.interface.errors import ConfigError
from deepshard.interface.placement import Replicate, Shard
from deepshard.testing import run_on_mesh


def _llama(heads: int, kv_heads: int, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=heads, num_key_value_heads=kv_heads, tie_word_embeddings=False,
    )  # fmt: skip
    return LlamaForCausalLM(config).float().eval()


class _OldStyleAttention(nn.Module):
    """Attention that reshapes with its own head-count attributes, as older HF models do."""

    def __init__(self) -> None:
        super().__init__()
        self.num_heads, self.num_key_value_heads, self.head_dim = 4, 2, 4
        self.hidden_size = 16  # num_heads * head_dim: the attention width
        self.q_proj = nn.Linear(16, 16)
        self.k_proj = nn.Linear(16, 8)
        self.o_proj = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self.q_proj(x).view(x.shape[0], self.num_heads, self.head_dim)
        k = self.k_proj(x).view(x.shape[0], self.num_key_value_heads, self.head_dim)
        k = k.repeat_interleave(self.num_heads // self.num_key_value_heads, dim=1)
        mixed = (q * k).softmax(-1) * q
        return self.o_proj(mixed.reshape(x.shape[0], self.hidden_size))


class _OldStyle(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = _OldStyleAttention()
        self.mlp = nn.Sequential(nn.Linear(16, 16))
        self.mlp.hidden_size = 16  # type: ignore[assignment]  # not in a split subtree


def _head_attributes(mesh: Any) -> dict[str, Any]:
    torch.manual_seed(0)
    reference = _OldStyle()
    plan = TPPlan(2, (
        LayerPlan("attn.q_proj", Style.COLUMN, ((8, 8),)),
        LayerPlan("attn.k_proj", Style.COLUMN, ((4, 4),)),
        LayerPlan("attn.o_proj", Style.ROW, ((8, 8),)),
    ))  # fmt: skip
    model = parallelize(copy.deepcopy(reference), mesh, plan=plan)
    x = torch.randn(3, 16)
    attn = model.get_submodule("attn")
    return {
        "error": (model.attn(x) - reference.attn(x)).abs().max().item(),
        "attrs": (attn.num_heads, attn.num_key_value_heads, attn.hidden_size, attn.head_dim),
        "mlp": model.get_submodule("mlp").hidden_size,
    }


def _placements(mesh: Any) -> dict[str, Any]:
    model = parallelize(_llama(8, 2, 0), mesh)
    registry = tp_state(model).placements
    return {
        name: (registry[name].global_shape, registry[name].placement("tp"),
               registry[name].reduce_over)
        for name in ("model.layers.0.self_attn.q_proj.weight",
                     "model.layers.0.self_attn.o_proj.weight",
                     "model.embed_tokens.weight", "model.norm.weight")
    }  # fmt: skip


def _freed(mesh: Any) -> dict[str, bool]:
    model = _llama(8, 2, 0)
    replaced = weakref.ref(model.get_submodule("model.layers.0.self_attn.q_proj"))
    parallelize(model, mesh)
    gc.collect()
    replaced_freed = replaced() is None
    whole = weakref.ref(model)
    del model
    gc.collect()
    return {"replaced": replaced_freed, "model": whole() is None}


def _two_models(mesh: Any, ids: torch.Tensor) -> dict[str, Any]:
    first_ref = _llama(8, 2, 0)
    first = parallelize(copy.deepcopy(first_ref), mesh)
    plan_before = plan_of(first)
    shards_before = {n: p.detach().clone() for n, p in first.named_parameters()}
    second = parallelize(_llama(4, 4, 1), mesh)
    with torch.no_grad():
        logits_error = (first(input_ids=ids).logits - first_ref(input_ids=ids).logits).abs().max()
    return {
        "plan_kept": plan_of(first) == plan_before and plan_before != plan_of(second),
        "shards_kept": all(torch.equal(p, shards_before[n]) for n, p in first.named_parameters()),
        "k_rows": (
            first.get_submodule("model.layers.0.self_attn.k_proj").weight.shape[0],
            second.get_submodule("model.layers.0.self_attn.k_proj").weight.shape[0],
        ),
        "logits_error": logits_error.item(),
        "states_distinct": tp_state(first) is not tp_state(second),
    }


def _generate(mesh: Any, ids: torch.Tensor) -> dict[str, Any]:
    reference = _llama(8, 2, 0)
    model = parallelize(copy.deepcopy(reference), mesh)
    with torch.no_grad():
        kwargs = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
        return {"tp": model.generate(ids, **kwargs), "dense": reference.generate(ids, **kwargs)}


def _refusals(mesh: Any) -> dict[str, str]:
    attempts = {
        "plan size": lambda: parallelize(_llama(8, 2, 0), mesh, plan=make_plan(_llama(8, 2, 0), 1)),
        "autotp_size": lambda: parallelize(
            _llama(8, 2, 0), mesh, TensorParallelConfig(autotp_size=4)
        ),
        "twice": lambda: parallelize(parallelize(_llama(8, 2, 0), mesh), mesh),
        "not linear": lambda: parallelize(
            _llama(8, 2, 0),
            mesh,
            plan=TPPlan(2, (LayerPlan("model.norm", Style.COLUMN, ((32, 32),)),)),
        ),
    }
    messages = {}
    for name, attempt in attempts.items():
        try:
            attempt()
            messages[name] = "no error"
        except ConfigError as error:
            messages[name] = str(error)
    return messages


def _ranks(mesh: Any) -> dict[str, Any]:
    ids = torch.randint(0, 128, (2, 5), generator=torch.Generator().manual_seed(3))
    return {
        "freed": _freed(mesh),
        "two": _two_models(mesh, ids),
        "generate": _generate(mesh, ids),
        "refusals": _refusals(mesh),
        "heads": _head_attributes(mesh),
        "placements": _placements(mesh),
    }


def test_metadata_is_per_model_and_generation_works(tmp_path: Path) -> None:
    results = run_on_mesh(_ranks, 2, topology=Topology(tp=2), store_dir=tmp_path, timeout_s=120)
    for rank, result in enumerate(results):
        assert result["freed"] == {"replaced": True, "model": True}, rank
        two = result["two"]
        assert two["plan_kept"] and two["shards_kept"] and two["states_distinct"], rank
        assert two["k_rows"] == (8, 32), rank  # 2 KV heads of 8 / 4 KV heads of 16, over 2
        assert two["logits_error"] < 1e-5, rank
        generated = result["generate"]
        assert generated["tp"].shape == (2, 11)
        assert torch.equal(generated["tp"], generated["dense"]), rank
        refusals = result["refusals"]
        assert "make the plan with tp_size=2" in refusals["plan size"], refusals
        assert "autotp_size is 4" in refusals["autotp_size"], refusals
        assert "already tensor-parallelized" in refusals["twice"], refusals
        assert "needs an nn.Linear" in refusals["not linear"], refusals
        heads = result["heads"]
        assert heads["error"] < 1e-5 and heads["mlp"] == 16, heads
        assert heads["attrs"] == (2, 1, 8, 4), heads  # halves; head_dim untouched
        dense = ("dp", "ep", "sp")
        assert result["placements"] == {
            "model.layers.0.self_attn.q_proj.weight": ((64, 64), Shard(0), dense),
            "model.layers.0.self_attn.o_proj.weight": ((64, 64), Shard(1), dense),
            "model.embed_tokens.weight": ((128, 64), Shard(0), dense),
            "model.norm.weight": ((64,), Replicate(), dense),
        }
