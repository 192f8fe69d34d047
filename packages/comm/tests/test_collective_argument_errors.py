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
from deepshard.comm._groups import barrier_device_ids
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
    with pytest.raises(CommError, match=r"must have shape \(8,\) or \(4, 2\)"):
        comm.all_gather_into_tensor(torch.ones(2), group=mesh["tp"], output=torch.empty(6))


@pytest.mark.parametrize("shape", [(2, 8), (8, 3, 2), (4, 6), (24,), (1, 8, 3)])
def test_gather_output_of_the_right_size_but_wrong_shape_is_refused(
    mesh: DeviceMesh, shape: tuple[int, ...]
) -> None:
    # 24 elements like a gather of four (2, 3) shards, but neither (8, 3) nor (4, 2, 3).
    with pytest.raises(CommError, match=r"\(8, 3\) or \(4, 2, 3\)"):
        comm.all_gather_into_tensor(torch.ones(2, 3), group=mesh["tp"], output=torch.empty(shape))


def test_stacked_gather_output_must_be_contiguous(mesh: DeviceMesh) -> None:
    stacked = torch.empty(2, 4, 3).transpose(0, 1)  # shape (4, 2, 3), not contiguous
    with pytest.raises(CommError, match="contiguous"):
        comm.all_gather_into_tensor(torch.ones(2, 3), group=mesh["tp"], output=stacked)


def test_gather_of_a_0d_tensor_needs_a_flat_output(mesh: DeviceMesh) -> None:
    with pytest.raises(CommError, match=r"shape \(4,\)"):
        comm.all_gather_into_tensor(torch.tensor(1.0), group=mesh["tp"], output=torch.empty(2, 2))


@pytest.mark.parametrize("shape", [(3, 2), (6,), (1, 3, 2), (2, 3)])
def test_scatter_chunk_of_the_wrong_shape_is_refused(
    mesh: DeviceMesh, shape: tuple[int, ...]
) -> None:
    # (12, 2) over 4 ranks gives (3, 2) chunks: the first shape is right but the dtype is not.
    output = torch.empty(shape, dtype=torch.float64 if shape == (3, 2) else torch.float32)
    with pytest.raises(CommError, match=r"shape \(3, 2\) and dtype torch.float32"):
        comm.reduce_scatter_tensor(torch.ones(12, 2), group=mesh["tp"], output=output)


def test_negative_output_split_sizes_are_refused_before_allocating(mesh: DeviceMesh) -> None:
    tp = mesh["tp"]
    # Sums to 4 like the input, so only the sign check can catch it.
    with pytest.raises(CommError, match="non-negative entry per group rank"):
        comm.all_to_all_single(
            torch.ones(4, 2), group=tp, input_split_sizes=[1] * 4, output_split_sizes=[-1, 3, 1, 1]
        )
    # A negative total would otherwise reach torch's allocator as a negative dimension.
    with pytest.raises(CommError, match="non-negative entry per group rank"):
        comm.all_to_all_single(torch.ones(4, 2), group=tp, output_split_sizes=[-5, 0, 0, 0])
    with pytest.raises(CommError, match="non-negative entry per group rank"):
        comm.all_to_all_single(
            torch.ones(4, 2), group=tp, input_split_sizes=[2, -1, 2, 1], output_split_sizes=[1] * 4
        )


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
