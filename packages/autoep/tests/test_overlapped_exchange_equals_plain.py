"""The overlapped exchange gives the plain exchange's rows and gradients, on 2 and 4 gloo ranks.

`overlapped_exchange` keeps a rank's rows for its own experts out of the all-to-all and runs
them while the other rows travel, in forward and in backward (`_Launch` / `_Land`). Each rank
here builds seeded rows, counts and experts, and runs the same loss through the plain path
(`AllToAllTransport.dispatch` → `run_by_source` → `combine`) and through the overlapped one:
the outputs, the rows' gradients and both expert weights' gradients must agree. The count
patterns cover a rank with no rows for its own experts, a rank with no rows for any other
rank, and a rank with no rows at all; both the grouped GEMM and the per-expert loop run.

Without processes: an eval forward (``no_grad``, ``inference_mode``) that reaches the CPU
grouped-GEMM probe first no longer leaves it cached as a failure.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from deepshard.autoep import AllToAllTransport, GroupedExperts, _grouped_experts
from deepshard.autoep._ep_layer import run_by_source
from deepshard.autoep._overlap import overlapped_exchange
from deepshard.interface import Topology
from deepshard.testing import run_on_mesh

HIDDEN = 8
PER_RANK = 2  # local experts


def _counts(case: str, rank: int, world: int) -> torch.Tensor:
    experts = PER_RANK * world
    gen = torch.Generator().manual_seed(10 * world + rank)
    counts = torch.randint(0, 4, (experts,), generator=gen)
    own = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
    if case == "own-empty" and rank == 0:
        counts[own] = 0
    if case == "only-own" and rank == 1:
        kept = counts[own].clone()
        counts.zero_()
        counts[own] = kept + 1
    if case == "rank-empty" and rank == world - 1:
        counts.zero_()
    return counts


def _experts(rank: int, grouped: bool) -> GroupedExperts:
    gen = torch.Generator().manual_seed(100 + rank)
    gate_up = torch.randn(PER_RANK, 2 * 6, HIDDEN, generator=gen)
    down = torch.randn(PER_RANK, HIDDEN, 6, generator=gen)
    return GroupedExperts(
        torch.nn.Parameter(gate_up), torch.nn.Parameter(down), F.silu, use_grouped_mm=grouped
    )


def _both_paths(mesh: Any, case: str, grouped: bool) -> dict[str, Any]:
    rank, world = mesh.get_rank(), mesh["ep"].size()
    transport = AllToAllTransport(mesh["ep"])
    counts = _counts(case, rank, world)
    gen = torch.Generator().manual_seed(200 + rank)
    source = torch.randn(int(counts.sum()), HIDDEN, generator=gen)
    weight = torch.randn(int(counts.sum()), HIDDEN, generator=gen)
    results = {}
    for path in ("plain", "overlapped"):
        experts = _experts(rank, grouped)
        rows = source.clone().requires_grad_(True)
        if path == "plain":
            received, table, plan = transport.dispatch(rows, counts)
            back = transport.combine(run_by_source(experts, received, table), plan)
        else:
            table = transport.exchange_counts(counts)
            back = overlapped_exchange(
                rows,
                counts,
                table,
                group=transport.process_group,
                run=lambda r, c, e=experts: run_by_source(e, r, c),
            )
        (back * weight).sum().backward()
        results[path] = {
            "back": back.detach(),
            "rows": rows.grad,
            "gate_up": experts.gate_up_proj.grad,
            "down": experts.down_proj.grad,
        }
    return results


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("case", ["uneven", "own-empty", "only-own", "rank-empty"])
@pytest.mark.parametrize("grouped", [True, False], ids=["grouped", "loop"])
def test_overlapped_exchange_equals_the_plain_one(
    world: int, case: str, grouped: bool, tmp_path: Path
) -> None:
    results = run_on_mesh(
        _both_paths, world, topology=Topology(ep=world), args=(case, grouped), store_dir=tmp_path
    )
    for rank, result in enumerate(results):
        plain, overlapped = result["plain"], result["overlapped"]
        for key in ("back", "rows", "gate_up", "down"):
            assert plain[key] is not None and overlapped[key] is not None, (rank, key)
            torch.testing.assert_close(
                overlapped[key], plain[key], rtol=1e-5, atol=1e-5, msg=f"rank {rank} {key}"
            )
    assert any(r["plain"]["back"].numel() for r in results)  # rows did travel


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_the_grouped_mm_probe_survives_a_first_call_without_grad(mode: str) -> None:
    agrees = _grouped_experts._cpu_grouped_mm_agrees
    agrees.cache_clear()
    try:
        context = torch.no_grad() if mode == "no_grad" else torch.inference_mode()
        with context:
            first = agrees(torch.float32)
        assert first is True
        assert agrees(torch.float32) is True
    finally:
        agrees.cache_clear()
