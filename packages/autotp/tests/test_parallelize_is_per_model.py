"""``parallelize`` keeps its metadata per model, frees what it replaced, generates, and refuses
bad input with typed errors (2 gloo ranks).

* A replaced ``nn.Linear`` is freed once ``parallelize`` returns, and dropping the model frees
  it: no DeepShard bookkeeping holds either (checked with ``weakref``).
* Two models with different head counts in one process: parallelizing the second leaves the
  first one's plan, shards and logits unchanged.
* ``parallelize`` + ``torch.no_grad()`` greedy generation (with the KV cache) gives the
  unsharded model's tokens.
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
from deepshard.testing import run_on_mesh


def _llama(heads: int, kv_heads: int, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=heads, num_key_value_heads=kv_heads, tie_word_embeddings=False,
    )  # fmt: skip
    return LlamaForCausalLM(config).float().eval()


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
