"""Stages 0-1 overwrite their gradient buffer after a step instead of zero-filling it: the first
pass after a step copies each parameter's first gradient in and zeroes the slots that got none.
This checks that the sums stay exact where that could go wrong, on 2 ranks against a
one-process reference: a parameter that had gradients in the last step gets none in a
non-boundary first pass (its stale slot must be zeroed when the pass ends), none on one rank
in a boundary first pass (zeroed before its bucket is reduced, while the other rank's
gradient still counts), and gradients in later micro-steps only (added onto the zeroed slot).
Stage 1's fp32 partition is one tensor reused by every step.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from deepshard.testing import import_beside, run_on_mesh

pytestmark = pytest.mark.slow  # 2 ranks, many cases: the main run covers it

_training = import_beside(__file__, "_training.py")
WORLD = 2
# Per step, per micro-step: the ranks whose forward uses the branch ``b``.
SCHEDULE: tuple[tuple[frozenset[int], ...], ...] = (
    (frozenset({0, 1}), frozenset({0, 1})),  # both ranks fill b's slot: stale after the step
    (frozenset(), frozenset({0})),  # a non-boundary first pass without b, then rank 0 only
    (frozenset({0}), frozenset()),  # rank 1 never uses b; rank 0 in the first pass only
    (frozenset({1}),),  # one boundary pass: rank 0 has no b gradient, rank 1 has one
    (frozenset({0, 1}),),
)


class TwoBranches(torch.nn.Module):
    """``a(x)``, plus ``b(x)`` when the schedule says so."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(_training.SIZES[0], _training.SIZES[-1])
        self.b = torch.nn.Linear(_training.SIZES[0], _training.SIZES[-1])

    def forward(self, x: torch.Tensor, use_b: bool) -> torch.Tensor:
        return self.a(x) + self.b(x) if use_b else self.a(x)


def _inner(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=_training.LR, weight_decay=0.5)


def _loss(model: TwoBranches, step: int, micro: int, rank: int) -> torch.Tensor:
    x, y = _training.batch(step)
    ga = len(SCHEDULE[step])
    mb = _training.GLOBAL_BATCH // (WORLD * ga)
    rows = slice((micro * WORLD + rank) * mb, (micro * WORLD + rank + 1) * mb)
    out = model(x[rows], rank in SCHEDULE[step][micro])
    return torch.nn.functional.mse_loss(out, y[rows]) / ga


def _train(group: Any, stage: int) -> dict[str, Any]:
    from deepshard.interface.config import ZeroConfig
    from deepshard.zero import ZeroOptimizer

    rank = group.get_rank()
    model = TwoBranches()
    # a small bucket puts a and b in buckets of their own, so b's bucket can be incomplete
    config = ZeroConfig(stage=stage, reduce_bucket_size=128)
    zero = ZeroOptimizer(_inner(model), group=group, config=config, gradient_clipping=1.0)
    partitions = set()
    for step, micros in enumerate(SCHEDULE):
        for micro in range(len(micros)):
            zero.backward(_loss(model, step, micro, rank), is_boundary=micro == len(micros) - 1)
        if stage == 1:
            store = zero._store.ordinary
            partitions.update(p.data_ptr() for p in store.partitions or [])
        zero.step()
    return {"params": [p.detach().clone() for p in model.parameters()], "ptrs": len(partitions)}


def _all(mesh: Any) -> dict[int, dict[str, Any]]:
    return {stage: _train(mesh["dp"], stage) for stage in (0, 1)}


def _reference() -> list[torch.Tensor]:
    model = TwoBranches()
    inner = _inner(model)
    for step, micros in enumerate(SCHEDULE):
        inner.zero_grad()
        for micro in range(len(micros)):
            for rank in range(WORLD):
                (_loss(model, step, micro, rank) / WORLD).backward()
        torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.grad is not None], 1.0)
        for p in model.parameters():
            if p.grad is None:
                p.grad = torch.zeros_like(p)  # ZeRO's treatment of a parameter with no gradient
        inner.step()
    return [p.detach().clone() for p in model.parameters()]


def test_stale_buffer_is_overwritten_exactly(tmp_path: Path) -> None:
    per_rank = run_on_mesh(_all, WORLD, store_dir=tmp_path)
    want = _reference()
    names = [n for n, _ in TwoBranches().named_parameters()]
    for out in per_rank:
        for stage in (0, 1):
            for name, got, ref in zip(names, out[stage]["params"], want, strict=True):
                torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-7, msg=f"{stage} {name}")
        assert out[1]["ptrs"] == 1, "stage 1 allocated a new gradient partition per step"
