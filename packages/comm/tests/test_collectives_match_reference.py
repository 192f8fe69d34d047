"""Every collective on 2 and 4 gloo ranks equals a single-process computation of the same inputs.

Each rank builds its inputs from a seed and its rank; the test rebuilds every rank's inputs in
the parent and computes what each rank must end with using plain tensor ops (sum, cat, split).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import deepshard.comm as comm
from deepshard.interface import Topology

ROWS, COLS = 4, 3  # per-rank rows of the reduced tensors; divisible by 2 and 4


def _input(seed: int, rank: int, shape: tuple[int, ...]) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * seed + rank)
    return torch.randn(shape, generator=gen)


def _a2a_splits(sender: int, n: int) -> list[int]:
    """Uneven rows `sender` sends to each rank (zeros included)."""
    return [(sender + 2 * j) % 3 for j in range(n)]


def _reduce_all(body_rank: int, group: Any) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for op in ("sum", "avg", "max", "min"):
        out[op] = comm.all_reduce(_input(1, body_rank, (ROWS, COLS)), group=group, op=op).wait()
    small = 1.0 + 0.1 * _input(2, body_rank, (ROWS,))
    out["product"] = comm.all_reduce(
        small, group=group, op=torch.distributed.ReduceOp.PRODUCT
    ).wait()
    return out


def _all_collectives(mesh: Any) -> dict[str, Any]:
    rank, group = mesh.get_rank(), mesh["dp"]
    n = mesh["dp"].size()
    out: dict[str, Any] = _reduce_all(rank, group)

    handle = comm.all_reduce(_input(3, rank, (ROWS, COLS)), group=group, async_op=True)
    first = handle.wait()
    out["async_sum"] = first
    out["async_same_object"] = handle.wait() is first and handle.is_completed()

    out["gather"] = comm.all_gather_into_tensor(_input(4, rank, (2, COLS)), group=group).wait()
    gathered = torch.empty(2 * n, COLS)
    gh = comm.all_gather_into_tensor(
        _input(4, rank, (2, COLS)), group=group, output=gathered, async_op=True
    )
    out["gather_async_is_output"] = gh.wait() is gathered and gh.wait() is gathered
    out["gather_0d"] = comm.all_gather_into_tensor(_input(9, rank, ()), group=group).wait()
    out["gather_stacked"] = comm.all_gather_into_tensor(
        _input(4, rank, (2, COLS)), group=group, output=torch.empty(n, 2, COLS)
    ).wait()
    for op in ("sum", "avg"):
        rs = comm.reduce_scatter_tensor(_input(5, rank, (ROWS, COLS)), group=group, op=op)
        out[f"rs_{op}"] = rs.wait()

    out["a2a_even"] = comm.all_to_all_single(_input(6, rank, (ROWS, COLS)), group=group).wait()
    in_splits = _a2a_splits(rank, n)
    out_splits = [_a2a_splits(j, n)[rank] for j in range(n)]
    a2a = comm.all_to_all_single(
        _input(7, rank, (sum(in_splits), COLS)),
        group=group,
        input_split_sizes=in_splits,
        output_split_sizes=out_splits,
        async_op=True,
    )
    out["a2a_uneven"] = a2a.wait()
    out["a2a_uneven_again"] = a2a.wait()

    out["bcast"] = comm.broadcast(_input(8, rank, (COLS,)), group_src=n - 1, group=group).wait()
    assert comm.barrier(group=group).wait() is None
    assert comm.barrier(group=group, async_op=True, device_ids=[0]).wait() is None
    return out


def _expected(rank: int, n: int) -> dict[str, torch.Tensor]:
    xs = torch.stack([_input(1, r, (ROWS, COLS)) for r in range(n)])
    small = torch.stack([1.0 + 0.1 * _input(2, r, (ROWS,)) for r in range(n)])
    rs_in = torch.stack([_input(5, r, (ROWS, COLS)) for r in range(n)])
    chunk = ROWS // n
    even_parts = [_input(6, j, (ROWS, COLS)).split(chunk) for j in range(n)]
    uneven_parts = [
        _input(7, j, (sum(_a2a_splits(j, n)), COLS)).split(_a2a_splits(j, n)) for j in range(n)
    ]
    return {
        "sum": xs.sum(0),
        "avg": xs.mean(0),
        "max": xs.amax(0),
        "min": xs.amin(0),
        "product": small.prod(0),
        "async_sum": torch.stack([_input(3, r, (ROWS, COLS)) for r in range(n)]).sum(0),
        "gather": torch.cat([_input(4, r, (2, COLS)) for r in range(n)]),
        "gather_0d": torch.stack([_input(9, r, ()) for r in range(n)]),
        "gather_stacked": torch.stack([_input(4, r, (2, COLS)) for r in range(n)]),
        "rs_sum": rs_in.sum(0)[rank * chunk : (rank + 1) * chunk],
        "rs_avg": rs_in.mean(0)[rank * chunk : (rank + 1) * chunk],
        "a2a_even": torch.cat([parts[rank] for parts in even_parts]),
        "a2a_uneven": torch.cat([parts[rank] for parts in uneven_parts]),
        "a2a_uneven_again": torch.cat([parts[rank] for parts in uneven_parts]),
        "bcast": _input(8, n - 1, (COLS,)),
    }


@pytest.mark.parametrize("world", [2, 4])
def test_collectives_match_single_process_reference(run_on_mesh: Any, world: int) -> None:
    results = run_on_mesh(_all_collectives, world)
    for rank, got in enumerate(results):
        assert got.pop("async_same_object") is True
        assert got.pop("gather_async_is_output") is True
        expected = _expected(rank, world)
        assert got.keys() == expected.keys()
        for key, want in expected.items():
            torch.testing.assert_close(got[key], want, msg=f"rank {rank}: {key}")


# --- sub-groups of a 2-D mesh: Topology(dp=2, tp=2), tp innermost, rank = 2 * dp + tp ---


def _members(rank: int, axis: str) -> list[int]:
    dp, tp = divmod(rank, 2)
    return [2 * dp + t for t in range(2)] if axis == "tp" else [2 * d + tp for d in range(2)]


def _subgroup_collectives(mesh: Any) -> dict[str, torch.Tensor]:
    rank = mesh.get_rank()
    tp, dp = mesh["tp"], mesh.get_group("dp")  # a 1-D mesh and a ProcessGroup
    in_splits = _a2a_splits(rank, 2)
    me = _members(rank, "dp").index(rank)  # this rank's index within its dp group
    out_splits = [_a2a_splits(j, 2)[me] for j in _members(rank, "dp")]
    return {
        "tp_sum": comm.all_reduce(_input(1, rank, (ROWS, COLS)), group=tp).wait(),
        "dp_max": comm.all_reduce(_input(1, rank, (ROWS, COLS)), group=dp, op="max").wait(),
        "tp_rs_avg": comm.reduce_scatter_tensor(
            _input(2, rank, (ROWS, COLS)), group=tp, op="avg"
        ).wait(),
        "dp_gather": comm.all_gather_into_tensor(_input(3, rank, (COLS,)), group=dp).wait(),
        "tp_bcast": comm.broadcast(_input(4, rank, (COLS,)), group_src=1, group=tp).wait(),
        "dp_a2a": comm.all_to_all_single(
            _input(5, rank, (sum(in_splits), COLS)),
            group=dp,
            input_split_sizes=in_splits,
            output_split_sizes=out_splits,
        ).wait(),
    }


def _subgroup_expected(rank: int) -> dict[str, torch.Tensor]:
    tp, dp = _members(rank, "tp"), _members(rank, "dp")
    tp_pos = tp.index(rank)
    rs_sum = torch.stack([_input(2, r, (ROWS, COLS)) for r in tp]).mean(0)
    a2a_parts = [_input(5, r, (sum(_a2a_splits(r, 2)), COLS)).split(_a2a_splits(r, 2)) for r in dp]
    return {
        "tp_sum": torch.stack([_input(1, r, (ROWS, COLS)) for r in tp]).sum(0),
        "dp_max": torch.stack([_input(1, r, (ROWS, COLS)) for r in dp]).amax(0),
        "tp_rs_avg": rs_sum.chunk(2)[tp_pos],
        "dp_gather": torch.cat([_input(3, r, (COLS,)) for r in dp]),
        "tp_bcast": _input(4, tp[1], (COLS,)),
        "dp_a2a": torch.cat([parts[dp.index(rank)] for parts in a2a_parts]),
    }


def test_collectives_on_sub_groups_of_a_2d_mesh(run_on_mesh: Any) -> None:
    results = run_on_mesh(_subgroup_collectives, 4, topology=Topology(dp=2, tp=2))
    for rank, got in enumerate(results):
        for key, want in _subgroup_expected(rank).items():
            torch.testing.assert_close(got[key], want, msg=f"rank {rank}: {key}")
