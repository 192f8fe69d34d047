"""Parameter placements and their registry: local boxes, reduction groups, bad input (no torch)."""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass

import pytest

from deepshard.interface import (
    FlatShard,
    ParamPlacement,
    PlacementRegistry,
    Replicate,
    Shard,
    Topology,
)
from deepshard.interface.errors import CheckpointError, TopologyError


@dataclass(frozen=True)
class _FakeParam:
    """Stands in for a torch parameter: the registry only reads ``shape`` and ``dtype``."""

    shape: tuple[int, ...]
    dtype: str


def test_plain_model_is_replicated_everywhere_and_reduced_over_dense_dp() -> None:
    topology = Topology(dp=2, ep=2, tp=2)
    named = [("w", _FakeParam((6, 4), "torch.bfloat16")), ("b", _FakeParam((4,), "torch.float32"))]
    registry = PlacementRegistry.replicated(named, topology)
    assert list(registry) == ["w", "b"] and len(registry) == 2
    w = registry.require("w")
    assert (w.global_shape, w.dtype, w.axes) == ((6, 4), "bfloat16", Topology.AXES)
    assert w.placements == (Replicate(),) * 5 and w.reduce_over == ("dp", "ep", "sp")
    assert registry["b"].dtype == "float32"
    for rank in range(topology.world_size):
        assert w.local_box(topology, topology.coords(rank)) == ((0, 0), (6, 4))
    experts = PlacementRegistry.replicated(named, topology, reduce_over=Topology.expert_dp_axes)
    assert experts["w"].reduce_over == ("dp",)


def _tiles(placement: ParamPlacement, topology: Topology) -> dict[int, set[tuple[int, int]]]:
    """Global (row, col) cells of every rank's box."""
    cells = {}
    for rank in range(topology.world_size):
        offset, shape = placement.local_box(topology, topology.coords(rank))
        rows = range(offset[0], offset[0] + shape[0])
        cols = range(offset[1], offset[1] + shape[1])
        cells[rank] = set(itertools.product(rows, cols))
    return cells


def test_tensor_and_expert_shards_tile_the_tensor_in_mesh_order() -> None:
    topology = Topology(dp=2, ep=2, tp=2)
    # ep splits dim 0 into halves, then tp splits each half again (outer axis first).
    placement = (
        ParamPlacement.replicated((8, 6), "float32", reduce_over=("dp",))
        .with_axis("ep", Shard(0))
        .with_axis("tp", Shard(0))
    )
    assert placement.local_shape(topology) == (2, 6)
    cells = _tiles(placement, topology)
    for rank, held in cells.items():
        c = topology.coords(rank)
        first_row = c["ep"] * 4 + c["tp"] * 2  # independent of the code: 8 rows = ep halves × tp
        assert held == set(itertools.product(range(first_row, first_row + 2), range(6)))
    # replicas along dp hold the same box; all boxes together cover the tensor exactly once
    distinct = {frozenset(held) for held in cells.values()}
    assert len(distinct) == 4 and set().union(*distinct) == set(
        itertools.product(range(8), range(6))
    )


def test_flat_shard_and_json_round_trip() -> None:
    placement = ParamPlacement.replicated((3, 5), "bfloat16").with_axis("tp", Shard(1))
    masters = placement.with_axis("dp", FlatShard()).with_axis("sp", FlatShard())
    assert masters.flat_shard_axes == ("dp", "sp") and placement.flat_shard_axes == ()
    assert masters.placement("dp") == FlatShard() and masters.placement("tp") == Shard(1)
    restored = ParamPlacement.from_json(json.loads(json.dumps(masters.to_json())))
    assert restored == masters and restored.numel == 15


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: ParamPlacement.replicated((4,), "f").with_axis("dp", Shard(0)), "both shard"),
        (lambda: ParamPlacement.replicated((4,), "f").with_axis("tp", Shard(1)), "outside the 1"),
        (lambda: ParamPlacement.replicated((4,), "f").with_axis("xp", Shard(0)), "unknown axis"),
        (
            lambda: ParamPlacement.replicated((4,), "f", reduce_over=("dp",)).with_axis(
                "ep", FlatShard()
            ),
            "not in reduce_over",
        ),
        (lambda: ParamPlacement.replicated((4,), "f", reduce_over=("sp", "dp")), "order"),
        (lambda: ParamPlacement.replicated((4,), "f", reduce_over=("zp",)), "distinct axes"),
        (lambda: ParamPlacement((4,), "f", (Replicate(),), ("dp",)), "one entry per"),
        (lambda: ParamPlacement((-1,), "f", (Replicate(),) * 5, ()), "non-negative"),
        (lambda: ParamPlacement((4,), "f", ("shard",) * 5, ()), "is not Replicate"),  # type: ignore[arg-type]
    ],
)
def test_bad_placements_name_the_axis_and_the_fix(build: object, message: str) -> None:
    with pytest.raises(TopologyError, match=message):
        build()  # type: ignore[operator]


def test_registry_refuses_what_does_not_fit_its_topology() -> None:
    registry = PlacementRegistry(Topology(dp=1, tp=2))
    with pytest.raises(TopologyError, match="does not split evenly over 2 ranks"):
        registry.set("w", ParamPlacement.replicated((5, 2), "float32").with_axis("tp", Shard(0)))
    with pytest.raises(TopologyError, match="not the topology's"):
        registry.set("w", ParamPlacement.replicated((4,), "float32", reduce_over=(), axes=("tp",)))
    with pytest.raises(TopologyError, match=r"'missing' has no placement.*replicated"):
        registry.require("missing")
    with pytest.raises(KeyError):
        registry["missing"]
    column = ParamPlacement.replicated((4, 2), "float32").with_axis("tp", Shard(0))
    registry.set("w", ParamPlacement.replicated((4, 2), "float32"))
    registry.set("w", column)  # a parallelising package refines the default
    assert registry["w"] is column


def test_malformed_json_is_a_checkpoint_error() -> None:
    good = ParamPlacement.replicated((2,), "float32").to_json()
    for broken in ({**good, "placements": [{"kind": "split"}] * 5}, {"dtype": "float32"}):
        with pytest.raises(CheckpointError, match="malformed parameter placement"):
            ParamPlacement.from_json(broken)
