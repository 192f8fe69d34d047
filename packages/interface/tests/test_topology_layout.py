"""Topology rank arithmetic, checked against an independent enumeration with itertools.product."""

from __future__ import annotations

import itertools

import pytest

from deepshard.interface import Topology, TopologyError

SHAPES = [(1, 1, 1, 1, 1), (1, 4, 1, 1, 2), (2, 2, 2, 1, 1), (1, 2, 2, 2, 2), (2, 3, 1, 2, 1)]


def _enumerated(shape: tuple[int, ...]) -> list[dict[str, int]]:
    """Coordinates in rank order: itertools.product varies the last axis (tp) fastest."""
    return [dict(zip(Topology.AXES, c, strict=True)) for c in itertools.product(*map(range, shape))]


def _topology(shape: tuple[int, ...]) -> Topology:
    return Topology(**dict(zip(Topology.AXES, shape, strict=True)))


@pytest.mark.parametrize("shape", SHAPES)
def test_coords_and_rank_of_match_the_enumeration(shape: tuple[int, ...]) -> None:
    topo = _topology(shape)
    expected = _enumerated(shape)
    assert topo.world_size == len(expected)
    assert topo.shape == shape and topo.axis_names == ("pp", "dp", "ep", "sp", "tp")
    for rank, coords in enumerate(expected):
        assert topo.coords(rank) == coords
        assert topo.rank_of(**coords) == rank


@pytest.mark.parametrize("shape", SHAPES)
def test_ranks_along_each_axis_are_the_ranks_differing_only_there(shape: tuple[int, ...]) -> None:
    topo = _topology(shape)
    expected = _enumerated(shape)
    for axis, rank in itertools.product(Topology.AXES, range(topo.world_size)):
        mine = expected[rank]
        others = tuple(
            r
            for r, c in enumerate(expected)
            if all(c[a] == mine[a] for a in Topology.AXES if a != axis)
        )
        assert topo.ranks_along(axis, rank) == others


def test_tensor_parallel_peers_are_adjacent() -> None:
    topo = Topology.from_world(8, tp=4)
    assert topo.ranks_along("tp", 5) == (4, 5, 6, 7)
    assert topo.ranks_along("dp", 5) == (1, 5)


@pytest.mark.parametrize(
    ("world", "kwargs"),
    [(8, {"tp": 2}), (24, {"tp": 2, "ep": 3}), (16, {"sp": 2, "tp": 2, "ep": 2}), (6, {"pp": 3})],
)
def test_from_world_derives_dp(world: int, kwargs: dict[str, int]) -> None:
    topo = Topology.from_world(world, **kwargs)
    fixed = 1
    for size in kwargs.values():
        fixed *= size
    assert topo.dp * fixed == world and topo.world_size == world
    for axis, size in kwargs.items():
        assert getattr(topo, axis) == size
    topo.check_world(world)


def test_from_world_indivisible_names_the_numbers() -> None:
    with pytest.raises(TopologyError, match=r"world size 10 is not divisible by .*tp 4 = 4"):
        Topology.from_world(10, tp=4)


def test_check_world_names_both_numbers() -> None:
    with pytest.raises(TopologyError, match="covers 8 ranks but the world has 6"):
        Topology(dp=4, tp=2).check_world(6)


@pytest.mark.parametrize(
    ("call", "fragment"),
    [
        (lambda t: t.coords(8), "outside 0..7"),
        (lambda t: t.coords(-1), "outside 0..7"),
        (lambda t: t.rank_of(dp=4), "dp=4 is outside 0..3"),
        (lambda t: t.rank_of(xp=0), "unknown axis 'xp'"),
        (lambda t: t.ranks_along("zz", 0), "unknown axis 'zz'"),
    ],
)
def test_bad_ranks_and_axes(call, fragment: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(TopologyError, match=fragment):
        call(Topology(dp=4, tp=2))


@pytest.mark.parametrize("kwargs", [{"dp": 0}, {"tp": -1}, {"mp": 2}])
def test_invalid_sizes_raise_topology_error(kwargs: dict[str, int]) -> None:
    with pytest.raises(TopologyError, match="invalid topology"):
        Topology(**kwargs)


@pytest.mark.parametrize("kwargs", [{"tp": 0}, {"world_size": 0}])
def test_from_world_rejects_non_positive(kwargs: dict[str, int]) -> None:
    args = {"world_size": 4, **kwargs}
    with pytest.raises(TopologyError, match="must be a positive integer"):
        Topology.from_world(args.pop("world_size"), **args)


def test_data_parallel_axes_are_documented_sizes() -> None:
    topo = Topology(dp=2, ep=3, sp=2, tp=2)
    assert Topology.dense_dp_axes == ("dp", "ep", "sp") and Topology.expert_dp_axes == ("dp",)
    assert topo.dense_dp_size == 2 * 3 * 2 and topo.batch_world_size == 2 * 3
