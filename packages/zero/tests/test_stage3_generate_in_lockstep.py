"""`generate` on a ZeRO-3 model finishes when the ranks finish at different steps.

A stage-3 forward gathers every unit's parameters over the data-parallel group, so a rank that
stops decoding early (its sequence hit EOS) would leave the others blocked in their next gather.
`shard` marks the model so that transformers' `generate` turns on ``synced_gpus`` by itself. On
2 gloo ranks each rank greedily decodes its own prompt with a tiny Qwen3; rank 0's EOS is the
token the unsharded model produces second, so it stops after 2 tokens while rank 1 decodes all
6; each output must equal the unsharded model's. A one-rank group gathers nothing and is not
marked.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch

from deepshard.comm.lockstep import COLLECTIVE_FORWARD_ATTRIBUTE
from deepshard.testing import greedy_new_tokens, import_beside, run_on_mesh

_qwen = import_beside(__file__, "test_stage3_world4_and_qwen3.py")

NEW_TOKENS = 6


def _greedy(model: Any, prompt: torch.Tensor, eos: int | None) -> list[int]:
    return greedy_new_tokens(model, prompt, max_new_tokens=NEW_TOKENS, eos_token_id=eos)


def _decode(mesh: Any) -> dict[str, Any]:
    from deepshard.zero import ZeroPolicy, shard

    group = mesh["dp"]
    rank = group.get_local_rank()
    model = _qwen._qwen3().eval()
    reference = copy.deepcopy(model)
    prompt = _qwen._tokens(0)[rank : rank + 1]
    eos = _greedy(reference, prompt, eos=None)[1] if rank == 0 else None
    expected = _greedy(reference, prompt, eos=eos)
    shard(model, group=group, policy=ZeroPolicy(param_persistence_threshold=0))
    return {
        "got": _greedy(model, prompt, eos=eos),
        "expected": expected,
        "marked": getattr(model, COLLECTIVE_FORWARD_ATTRIBUTE, False),
    }


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_ranks_finishing_apart_both_complete(tmp_path: Path) -> None:
    results = run_on_mesh(_decode, 2, store_dir=tmp_path)
    assert all(r["marked"] for r in results)
    assert len(results[0]["expected"]) < NEW_TOKENS  # rank 0 really stopped early
    assert len(results[1]["expected"]) == NEW_TOKENS
    for rank, result in enumerate(results):
        assert result["got"] == result["expected"], rank


def _one_rank(mesh: Any) -> bool:
    from deepshard.zero import shard

    model = _qwen._qwen3()
    shard(model, group=mesh["dp"])
    return bool(getattr(model, COLLECTIVE_FORWARD_ATTRIBUTE, False))


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_a_one_rank_group_is_not_marked(tmp_path: Path) -> None:
    assert run_on_mesh(_one_rank, 1, store_dir=tmp_path) == [False]
