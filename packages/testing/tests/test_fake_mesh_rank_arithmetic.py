"""fake_mesh: one rank of a larger world, in-process, with the coordinates and groups it has."""

from __future__ import annotations

import itertools

import pytest
import torch.distributed as dist

from deepshard.interface import Topology
from deepshard.interface.errors import CommError, TopologyError
from deepshard.testing import fake_mesh


@pytest.mark.parametrize(
    "topology",
    [Topology(dp=2, tp=2, pp=2), Topology(dp=1, ep=2, sp=3), Topology(dp=8)],
    ids=lambda t: "x".join(map(str, t.shape)),
)
def test_every_rank_sees_its_row_major_coordinates_and_groups(topology: Topology) -> None:
    grid = list(itertools.product(*(range(size) for size in topology.shape)))
    for rank in range(topology.world_size):
        with fake_mesh(topology, rank) as mesh:
            assert mesh.get_rank() == rank
            assert tuple(mesh.get_coordinate() or ()) == grid[rank]
            assert tuple(topology.coords(rank).values()) == grid[rank]
            for axis_index, axis in enumerate(Topology.AXES):
                members = [
                    r
                    for r, c in enumerate(grid)
                    if all(c[i] == grid[rank][i] for i in range(5) if i != axis_index)
                ]
                assert dist.get_process_group_ranks(mesh.get_group(axis)) == members
                assert sorted(topology.ranks_along(axis, rank)) == members
        assert not dist.is_initialized()


def test_rank_3_of_8() -> None:
    topology = Topology(pp=2, dp=2, tp=2)
    with fake_mesh(topology, 3) as mesh:
        # 3 = 0b011: pp 0, dp 1, tp 1 with tp innermost.
        assert tuple(mesh.get_coordinate() or ()) == (0, 1, 0, 0, 1)
        assert dist.get_process_group_ranks(mesh.get_group("tp")) == [2, 3]
        assert dist.get_process_group_ranks(mesh.get_group("dp")) == [1, 3]
        assert dist.get_process_group_ranks(mesh.get_group("pp")) == [3, 7]
        assert dist.get_world_size() == 8


@pytest.mark.parametrize("rank", [-1, 4, True, 1.0])
def test_rank_outside_the_world_is_rejected(rank: object) -> None:
    with (
        pytest.raises(TopologyError, match="outside the world of 4"),
        fake_mesh(Topology(dp=4), rank),  # type: ignore[arg-type]
    ):
        pass
    assert not dist.is_initialized()


def test_nesting_is_refused_and_the_outer_group_survives() -> None:
    with fake_mesh(Topology(dp=2), 0):
        with pytest.raises(CommError, match="already initialised"), fake_mesh(Topology(dp=2), 1):
            pass
        assert dist.get_world_size() == 2
    assert not dist.is_initialized()


def test_group_is_destroyed_when_the_body_raises() -> None:
    with pytest.raises(KeyError), fake_mesh(Topology(dp=2), 1):
        raise KeyError("body failed")
    assert not dist.is_initialized()
