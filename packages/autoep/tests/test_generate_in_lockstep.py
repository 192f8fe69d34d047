"""`generate` on an expert-parallel model finishes when the ranks finish at different steps.

Every forward of an expert-parallel model is a set of all-to-alls over the ``ep`` ranks, so a
rank that stops decoding early (its sequences hit EOS) would leave the others blocked in their
next exchange. `parallelize_experts` marks the model so that transformers' `generate` turns on
``synced_gpus`` by itself (the finished rank keeps stepping until every rank is done). On 2
gloo ranks each rank greedily decodes its own prompt from a tiny Mixtral; rank 0's EOS is the
token its unreplaced model produces second, so it finishes after 2 tokens while rank 1 runs
all 6. Each rank's output must equal the unreplaced single-process model's `generate` with the
same EOS, and so must a deep copy's (an RLHF reference model is one). A model replaced over one
rank exchanges nothing and stays unmarked.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch

from deepshard.autoep import parallelize_experts
from deepshard.comm import ParallelDims
from deepshard.comm.lockstep import COLLECTIVE_FORWARD_ATTRIBUTE
from deepshard.interface import Topology
from deepshard.testing import greedy_new_tokens, import_beside, run_on_mesh

_tiny_moe = import_beside(__file__, "_tiny_moe.py")

NEW_TOKENS = 6


def _greedy(model: Any, prompt: torch.Tensor, eos: int | None) -> list[int]:
    return greedy_new_tokens(model, prompt, max_new_tokens=NEW_TOKENS, eos_token_id=eos)


def _decode(mesh: Any) -> dict[str, Any]:
    dims = ParallelDims.from_mesh(mesh)
    rank = mesh.get_rank()
    model = _tiny_moe.build("mixtral").eval()
    reference = copy.deepcopy(model)
    prompt = _tiny_moe.batch(0, rank)[:1]
    free = _greedy(reference, prompt, eos=None)
    eos = free[1] if rank == 0 else None  # rank 0 stops after its second token
    expected = _greedy(reference, prompt, eos=eos)
    parallelize_experts(model, dims)
    marked = getattr(model, COLLECTIVE_FORWARD_ATTRIBUTE, False)
    twin = copy.deepcopy(model)  # e.g. an RLHF reference model copied from the policy
    got = _greedy(model, prompt, eos=eos)
    got_twin = _greedy(twin, prompt, eos=eos)
    return {"got": got, "twin": got_twin, "expected": expected, "marked": marked}


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_ranks_finishing_apart_both_complete(tmp_path: Path) -> None:
    results = run_on_mesh(_decode, 2, topology=Topology(ep=2), store_dir=tmp_path)
    assert all(r["marked"] for r in results)
    assert len(results[0]["expected"]) < NEW_TOKENS  # rank 0 really stopped early
    assert len(results[1]["expected"]) == NEW_TOKENS
    for rank, result in enumerate(results):
        assert result["got"] == result["expected"], rank
        assert result["twin"] == result["expected"], rank


def _one_rank(mesh: Any) -> bool:
    model = _tiny_moe.build("mixtral")
    parallelize_experts(model, ParallelDims.from_mesh(mesh))
    return bool(getattr(model, COLLECTIVE_FORWARD_ATTRIBUTE, False))


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_a_single_rank_model_is_not_marked(tmp_path: Path) -> None:
    assert run_on_mesh(_one_rank, 1, topology=Topology(ep=1), store_dir=tmp_path) == [False]
