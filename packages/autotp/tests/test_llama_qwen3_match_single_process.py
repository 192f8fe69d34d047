"""Tiny Llama and Qwen3 under ``parallelize`` on TP=2 and TP=4 match the unsharded model.

Each rank builds the same seeded model twice: the single-process reference, and a copy that
``parallelize`` splits with the plan ``make_plan`` chooses (its Hugging Face ``tp_plan``). Per
model and TP size: every shard has the shape the plan says; logits and loss equal the
reference's within 1e-5 (fp32); Qwen3's replicated ``q_norm``/``k_norm`` gradients equal the
reference's full gradients (a rank alone holds only its heads' part); after 5 AdamW steps with
gradient clipping at 1.0 every shard equals the matching slice of the reference, the slice
taken with ``torch.split`` of the plan's sizes. The clipping norm is a test-local TP-aware one
(squares of sharded gradients summed over TP, replicated ones counted once); ZeRO builds the
real one. TP=4 exceeds the 2 KV heads: ranks 2-3 hold no attention rows.
"""

from __future__ import annotations

import copy
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from deepshard.autotp import Style, parallelize, plan_of
from deepshard.interface import Topology
from deepshard.testing import run_on_mesh

# multi-rank and over ~3 s: the main run covers it, the package tox env deselects it
pytestmark = pytest.mark.slow

SHAPE = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=2,
    tie_word_embeddings=False,
)
DIMS = {
    Style.COLUMN: {"weight": 0, "bias": 0},
    Style.ROW: {"weight": 1},
    Style.VOCAB: {"weight": 0},
}


def _model(kind: str) -> nn.Module:
    torch.manual_seed(0)
    if kind == "llama":
        return LlamaForCausalLM(LlamaConfig(**SHAPE)).float()
    return Qwen3ForCausalLM(Qwen3Config(**SHAPE, head_dim=8)).float()


def _split_params(model: nn.Module) -> dict[str, tuple[int, tuple[int, ...]]]:
    """Name → (split dim, per-rank sizes) of every parameter the applied plan cuts."""
    plan = plan_of(model)
    assert plan is not None
    found = {}
    for layer in plan.layers:
        for local, dim in DIMS.get(layer.style, {}).items():
            if hasattr(model.get_submodule(layer.module), local) and layer.sizes:
                (sizes,) = layer.sizes
                found[f"{layer.module}.{local}"] = (dim, sizes)
    return found


def _expected(full: torch.Tensor, split: tuple[int, tuple[int, ...]] | None, rank: int) -> Any:
    if split is None:
        return full
    dim, sizes = split
    return full.split(list(sizes), dim=dim)[rank]


def _err(got: torch.Tensor, want: torch.Tensor) -> float:
    # A rank holding no rows of a layer (TP=4, 2 KV heads) has empty shards: nothing differs.
    return (got - want).abs().max().item() if got.numel() else 0.0


def _clip(model: nn.Module, split: dict[str, Any], group: dist.ProcessGroup) -> None:
    sharded = torch.zeros(())
    whole = torch.zeros(())
    for name, param in model.named_parameters():
        if param.grad is not None:
            square = param.grad.pow(2).sum()
            if name in split:
                sharded += square
            else:
                whole += square
    dist.all_reduce(sharded, group=group)
    norm = (sharded + whole).sqrt()
    scale = torch.clamp(1.0 / (norm + 1e-6), max=1.0)  # as torch's clip_grad_norm_
    for param in model.parameters():
        if param.grad is not None:
            param.grad.mul_(scale)


def _check_model(kind: str, mesh: Any) -> dict[str, float]:
    reference = _model(kind)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TP=4 > KV heads warns, as it should
        model = parallelize(copy.deepcopy(reference), mesh)
    tp = mesh["tp"]
    rank, group = tp.get_local_rank(), tp.get_group()
    split = _split_params(model)
    errors: dict[str, float] = {}
    ref_params = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        want = _expected(ref_params[name].detach(), split.get(name), rank)
        assert param.shape == want.shape, (name, param.shape, want.shape)
    torch.manual_seed(1)
    ids = torch.randint(0, SHAPE["vocab_size"], (2, 8))
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for step in range(5):
        out, ref_out = model(input_ids=ids, labels=ids), reference(input_ids=ids, labels=ids)
        if step == 0:
            errors["logits"] = _err(out.logits, ref_out.logits)
            errors["loss"] = (out.loss - ref_out.loss).abs().item()
        out.loss.backward()
        ref_out.loss.backward()
        if step == 0:
            for name, param in model.named_parameters():
                if "_norm" in name and "layernorm" not in name:  # q_norm / k_norm
                    assert param.grad is not None, name
                    errors[f"grad {name}"] = _err(param.grad, ref_params[name].grad)
        _clip(model, split, group)
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    for name, param in model.named_parameters():
        want = _expected(ref_params[name].detach(), split.get(name), rank)
        errors[f"after 5 steps {name}"] = _err(param.detach(), want)
    return errors


def _ranks(mesh: Any) -> dict[str, dict[str, float]]:
    return {kind: _check_model(kind, mesh) for kind in ("llama", "qwen3")}


@pytest.mark.parametrize("tp_size", [2, 4])
def test_tp_matches_the_single_process_model(tmp_path: Path, tp_size: int) -> None:
    results = run_on_mesh(
        _ranks, tp_size, topology=Topology(tp=tp_size), store_dir=tmp_path, timeout_s=150
    )
    for rank, result in enumerate(results):
        for kind, errors in result.items():
            assert any(k.startswith("grad ") for k in errors) == (kind == "qwen3")
            bad = {k: v for k, v in errors.items() if v > 1e-5}
            assert not bad, f"{kind} rank {rank}: {bad}"
