"""Bad arguments to the collectives fail with a CommError naming the fix, before any backend call.

Rank 3 of a fake 8-rank world (Topology(dp=2, tp=4)) plays the caller: no process is started and
no data moves, so every check here runs in one process.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from torch.distributed.device_mesh import DeviceMesh

import deepshard.comm as comm
from deepshard.comm.collectives import barrier_device_ids
from deepshard.interface import Topology
from deepshard.interface.errors import CommError
from deepshard.testing import fake_mesh


@pytest.fixture
def mesh() -> Iterator[DeviceMesh]:
    with fake_mesh(Topology(dp=2, tp=4), rank=3) as m:
        yield m


def test_multi_axis_mesh_is_refused_with_the_axis_to_pick(mesh: DeviceMesh) -> None:
    with pytest.raises(CommError, match=r"1-D mesh.*mesh\['tp'\]"):
        comm.all_reduce(torch.ones(2), group=mesh)
    with pytest.raises(CommError, match="ProcessGroup or a 1-D DeviceMesh"):
        comm.all_reduce(torch.ones(2), group="tp")  # type: ignore[arg-type]


def test_unknown_reduce_op_names_the_valid_ones(mesh: DeviceMesh) -> None:
    with pytest.raises(CommError, match=r"'mean'.*'avg'"):
        comm.all_reduce(torch.ones(2), group=mesh["tp"], op="mean")  # type: ignore[arg-type]


def test_average_of_integers_is_refused(mesh: DeviceMesh) -> None:
    with pytest.raises(CommError, match="floating-point"):
        comm.all_reduce(torch.ones(2, dtype=torch.int64), group=mesh["tp"], op="avg")


def test_reduce_scatter_needs_dim0_divisible_by_the_group(mesh: DeviceMesh) -> None:
    with pytest.raises(CommError, match="divisible by the group size 4"):
        comm.reduce_scatter_tensor(torch.ones(6, 2), group=mesh["tp"])


def test_output_of_the_wrong_size_is_refused(mesh: DeviceMesh) -> None:
    with pytest.raises(CommError, match="must have 8 elements"):
        comm.all_gather_into_tensor(torch.ones(2), group=mesh["tp"], output=torch.empty(6))


def test_all_to_all_split_sizes_are_checked(mesh: DeviceMesh) -> None:
    tp = mesh["tp"]
    with pytest.raises(CommError, match="one non-negative entry per group rank"):
        comm.all_to_all_single(torch.ones(4, 2), group=tp, input_split_sizes=[2, 2])
    with pytest.raises(CommError, match="sums to 5"):
        comm.all_to_all_single(
            torch.ones(4, 2), group=tp, input_split_sizes=[2, 1, 1, 1], output_split_sizes=[1] * 4
        )
    with pytest.raises(CommError, match=r"needs output_split_sizes|pass output_split_sizes"):
        comm.all_to_all_single(torch.ones(4, 2), group=tp, input_split_sizes=[1, 0, 2, 1])
    with pytest.raises(CommError, match="needs output_split_sizes"):
        comm.all_to_all_single_autograd(torch.ones(4, 2), group=tp, input_split_sizes=[1, 0, 2, 1])
    with pytest.raises(CommError, match="divisible by the group size 4"):
        comm.all_to_all_single(torch.ones(6, 2), group=tp)


def test_broadcast_source_is_a_group_rank(mesh: DeviceMesh) -> None:
    with pytest.raises(CommError, match="not a global rank"):
        comm.broadcast(torch.ones(2), group_src=5, group=mesh["tp"])


def test_barrier_forwards_device_ids_to_nccl_only() -> None:
    assert barrier_device_ids("nccl", (1,)) == [1]
    assert barrier_device_ids("gloo", (1,)) is None
    assert barrier_device_ids("nccl", None) is None
