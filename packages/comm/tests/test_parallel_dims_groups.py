"""ParallelDims: every derived group has the ranks the row-major grid says, for real too.

The expected members are enumerated here from ``itertools.product`` over the axis sizes (a rank
belongs to a group over axes S when it agrees with this rank on every axis outside S), not from
`Topology` arithmetic or the code under test.
"""

from __future__ import annotations

import itertools
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from deepshard.comm import ParallelDims, all_reduce
from deepshard.interface import Topology
from deepshard.interface.errors import TopologyError
from deepshard.testing import fake_mesh, run_on_mesh

AXES = ("pp", "dp", "ep", "sp", "tp")
GROUP_AXES = {
    "world": AXES,
    "dense_dp": ("dp", "ep", "sp"),
    "expert_dp": ("dp",),
    "batch": ("dp", "ep"),
    "tp": ("tp",),
    "sp": ("sp",),
    "ep": ("ep",),
}


def _expected(shape: tuple[int, ...], rank: int, axes: tuple[str, ...]) -> list[int]:
    grid = list(itertools.product(*(range(size) for size in shape)))
    mine = grid[rank]
    fixed = [i for i, axis in enumerate(AXES) if axis not in axes]
    return [r for r, c in enumerate(grid) if all(c[i] == mine[i] for i in fixed)]


@pytest.mark.parametrize(
    "topology", [Topology(dp=2, ep=2, tp=2), Topology(dp=2, ep=2, sp=2)], ids=["tp2", "sp2"]
)
@pytest.mark.parametrize("rank", [3, 6])
def test_derived_groups_of_rank_3_and_6_of_8(topology: Topology, rank: int) -> None:
    with fake_mesh(topology, rank) as mesh:
        dims = ParallelDims.from_mesh(mesh)
        for name, axes in GROUP_AXES.items():
            group = getattr(dims, name)
            assert group.ndim == 1, name
            members = dist.get_process_group_ranks(group.get_group())
            assert members == _expected(topology.shape, rank, axes), name
            assert group.get_local_rank() == members.index(rank), name
        batch = _expected(topology.shape, rank, ("dp", "ep"))
        assert (dims.batch_rank, dims.batch_world_size) == (batch.index(rank), len(batch))
        assert dims.rank == rank and dims.coordinate == topology.coords(rank)
        assert dims.dense_dp.mesh_dim_names == (
            "_".join(a for a in ("dp", "ep", "sp") if getattr(topology, a) > 1),
        )
        # axis order and size-1 axes do not matter
        assert dims.group_over(("ep", "pp", "dp")) is dims.batch
        with pytest.raises(TopologyError, match="no group over"):
            dims.group_over(("ep", "sp", "tp"))
        with pytest.raises(TopologyError, match="unknown axis 'xp'"):
            dims.group_over(("xp",))


def test_a_mesh_without_deepshards_axes_is_refused() -> None:
    with fake_mesh(Topology(dp=2), 0):
        plain = init_device_mesh("cpu", (2,), mesh_dim_names=("data",))
        with pytest.raises(TopologyError, match="build_mesh"):
            ParallelDims.from_mesh(plain)


def _sums(dims: ParallelDims) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for name in GROUP_AXES:
        group = getattr(dims, name)
        value = torch.tensor([2.0**dims.rank], dtype=torch.float64)
        result[name] = all_reduce(value, group=group).wait().item()
        backend = group.get_group()._get_backend(torch.device("cpu"))
        result[f"{name}_timeout"] = backend.options._timeout
    result["batch_rank"] = dims.batch_rank
    return result


def _all_reduce_everywhere(mesh: Any, topology: Topology) -> dict[str, Any]:
    # The harness's mesh, whose world-spanning groups reuse the default group, and a second
    # build with its own timeout, which creates new groups for the multi-axis sets.
    default = _sums(ParallelDims.from_mesh(mesh))
    explicit = _sums(ParallelDims.build(topology, timeout=timedelta(seconds=91)))
    return {"default": default, "explicit": explicit}


def test_all_reduce_over_every_group_on_4_ranks(tmp_path: Any) -> None:
    topology = Topology(dp=2, ep=2)
    results = run_on_mesh(
        _all_reduce_everywhere,
        4,
        args=(topology,),
        topology=topology,
        timeout_s=77.0,
        store_dir=tmp_path,
    )
    for rank, result in enumerate(results):
        for variant, timeout in (("default", 77), ("explicit", 91)):
            sums = result[variant]
            for name, axes in GROUP_AXES.items():
                # each rank adds 2**rank, so the sum names exactly the members
                expected = sum(2.0**r for r in _expected(topology.shape, rank, axes))
                assert sums[name] == expected, (variant, name)
                assert sums[f"{name}_timeout"] == timedelta(seconds=timeout), (variant, name)
            assert sums["batch_rank"] == rank  # dp × ep is the whole world here, in rank order
