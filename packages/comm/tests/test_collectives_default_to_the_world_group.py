"""Without `group=`, every collective runs on the default (world) group, as torch.distributed's.

On 2 gloo ranks each DeepShard collective is called without a group and compared with the
same `torch.distributed` call, also without a group, on a copy of the same input.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

import deepshard.comm as comm
from deepshard.interface.errors import CommError


def _input(rank: int, rows: int = 4) -> torch.Tensor:
    gen = torch.Generator().manual_seed(17 + rank)
    return torch.randn(rows, 3, generator=gen)


def _both_ways(mesh: Any) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    rank, size = mesh.get_rank(), dist.get_world_size()
    x = _input(rank)
    out: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    ours, ref = x.clone(), x.clone()
    comm.all_reduce(ours)
    dist.all_reduce(ref)
    out["all_reduce"] = (ours, ref)

    ref = torch.empty(size * 4, 3)
    dist.all_gather_into_tensor(ref, x)
    out["all_gather_into_tensor"] = (comm.all_gather_into_tensor(x).wait(), ref)

    ref = torch.empty(4 // size, 3)
    dist.reduce_scatter_tensor(ref, x.clone())
    out["reduce_scatter_tensor"] = (comm.reduce_scatter_tensor(x.clone()).wait(), ref)

    ref = torch.empty(4, 3)
    dist.all_to_all_single(ref, x)
    out["all_to_all_single"] = (comm.all_to_all_single(x).wait(), ref)

    ours, ref = x.clone(), x.clone()
    comm.broadcast(ours, group_src=1)
    dist.broadcast(ref, src=1)
    out["broadcast"] = (ours, ref)

    assert comm.barrier().wait() is None
    comm.all_reduce(x.clone(), async_op=True).wait()  # async without a group too
    return out


def test_every_collective_without_a_group_matches_torch_distributed(run_on_mesh: Any) -> None:
    for rank, results in enumerate(run_on_mesh(_both_ways, 2)):
        assert set(results) == {
            "all_reduce",
            "all_gather_into_tensor",
            "reduce_scatter_tensor",
            "all_to_all_single",
            "broadcast",
        }
        for name, (ours, ref) in results.items():
            assert torch.equal(ours, ref), (rank, name)
        # and the reference itself is what a single process computes from both inputs
        assert torch.allclose(results["all_reduce"][1], _input(0) + _input(1))
        assert torch.equal(results["broadcast"][1], _input(1))


def test_no_group_before_init_is_an_actionable_error() -> None:
    assert not dist.is_initialized()
    with pytest.raises(CommError, match=r"init_distributed\(\) first, or pass group="):
        comm.all_reduce(torch.ones(2))
