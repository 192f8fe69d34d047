"""`deepshard.zero._tp_maps.widen_over_tp`: a data-parallel group's shard map extended to every
tp coordinate, as pure data (no processes).

A ``Shard(1)`` (row-parallel) weight of global shape 4 × 6 on TP 2 × DP 2: each tp rank's box is
4 × 3 columns, and ZeRO cuts its 12 elements at 5 (a flat range inside the box is several row
pieces of the global tensor). The widened map must hold every element exactly once, give the
holder's global rank and tp coordinate, and round-trip a full tensor through extract/rebuild.
"""

from __future__ import annotations

import pytest

from deepshard.interface import ParamPlacement, Shard, ShardMap, ShardPiece, Topology
from deepshard.interface.errors import CheckpointError
from deepshard.zero._shards import _box_pieces
from deepshard.zero._tp_maps import widen_over_tp

TOPOLOGY = Topology(dp=2, tp=2)
ROW = ParamPlacement.replicated((4, 6), "float32").with_axis("tp", Shard(1))


def _dp_group_map(tp_coord: int) -> ShardMap:
    """ZeRO's map of the weight on the dp group at ``tp_coord``: ranks 0/1 hold [0,5) / [5,12)."""
    pieces = []
    for dp, (start, stop) in enumerate(((0, 5), (5, 12))):
        coords = (0, dp, 0, 0, tp_coord)
        offset, box = ROW.local_box(TOPOLOGY, dict(zip(TOPOLOGY.axis_names, coords, strict=True)))
        pieces.append(ShardPiece(dp, offset, box, start, stop, 0, coords))
    return ShardMap(
        (4, 6), "float32", tuple(pieces), ("dp", "ep", "sp"), TOPOLOGY.axis_names, TOPOLOGY.shape
    )


@pytest.mark.parametrize("tp_coord", [0, 1])
def test_widened_map_covers_every_slice_once(tp_coord: int) -> None:
    wide = widen_over_tp(_dp_group_map(tp_coord), ROW, TOPOLOGY)
    assert wide.axes == ("dp", "ep", "sp", "tp")
    wide.validate_coverage()
    holders = {(p.rank, p.box_offset, p.flat_start) for p in wide.pieces}
    # rank = dp * 2 + tp (the global rank); tp coordinate t holds columns [3t, 3t + 3)
    assert holders == {(0, (0, 0), 0), (1, (0, 3), 0), (2, (0, 0), 5), (3, (0, 3), 5)}
    assert all(wide.global_rank(p) == p.rank for p in wide.pieces)
    full = [float(i) for i in range(24)]
    shards = {r: wide.extract(full, r) for r in range(4)}
    assert shards[1] == [3.0, 4.0, 5.0, 9.0, 10.0]  # rows 0-1 of columns 3-5, cut at 5
    assert wide.rebuild(shards) == full


def test_replicated_tensor_gets_replicas_on_every_tp_rank() -> None:
    plain = ParamPlacement.replicated((4, 6), "float32")
    smap = ShardMap(
        (4, 6),
        "float32",
        (
            ShardPiece(0, (0, 0), (4, 6), 0, 10, 0, (0, 0, 0, 0, 0)),
            ShardPiece(1, (0, 0), (4, 6), 10, 24, 0, (0, 1, 0, 0, 0)),
        ),
        ("dp", "ep", "sp"),
        TOPOLOGY.axis_names,
        TOPOLOGY.shape,
    )
    wide = widen_over_tp(smap, plain, TOPOLOGY)
    wide.validate_coverage()  # equal pieces at tp 0 and 1 are replicas, not overlaps
    assert sorted((p.rank, p.flat_start) for p in wide.pieces) == [(0, 0), (1, 0), (2, 10), (3, 10)]


def test_a_map_that_already_spans_tp_is_refused() -> None:
    wide = widen_over_tp(_dp_group_map(0), ROW, TOPOLOGY)
    with pytest.raises(CheckpointError, match="leave tp out"):
        widen_over_tp(wide, ROW, TOPOLOGY)


GATE_UP = ParamPlacement.replicated((8, 3), "float32").with_axis("tp", Shard(0, (4, 4)))
"""A fused ``gate_up_proj`` (gate rows 0-3, up rows 4-7): tp rank ``t`` stores gate rows
``[2t, 2t + 2)`` then up rows ``[4 + 2t, 4 + 2t + 2)``, two boxes back to back."""


def _fused_dp_group_map(tp_coord: int) -> ShardMap:
    """ZeRO's map at ``tp_coord`` (`_box_pieces`, as ZeRO builds it): its 12 local elements cut
    at 5, so dp rank 1's range crosses from the gate box into the up box."""
    pieces = []
    for dp, (start, stop) in enumerate(((0, 5), (5, 12))):
        coords = (0, dp, 0, 0, tp_coord)
        named = dict(zip(TOPOLOGY.axis_names, coords, strict=True))
        boxes = GATE_UP.local_boxes(TOPOLOGY, named)
        pieces += _box_pieces(boxes, dp, (start, stop, 0), coords)
    return ShardMap(
        (8, 3), "float32", tuple(pieces), ("dp", "ep", "sp"), TOPOLOGY.axis_names, TOPOLOGY.shape
    )


@pytest.mark.parametrize("tp_coord", [0, 1])
def test_fused_weight_pieces_cross_boxes_and_widen(tp_coord: int) -> None:
    group = _fused_dp_group_map(tp_coord)
    crossing = [p for p in group.pieces if p.rank == 1]
    # dp rank 1 holds the gate box's last element and the whole up box, its local offsets
    # moving on by the elements before each piece
    assert [(p.flat_start, p.flat_stop, p.local_offset) for p in crossing] == [
        (5, 6, 0),
        (0, 6, 1),
    ]
    wide = widen_over_tp(group, GATE_UP, TOPOLOGY)
    wide.validate_coverage()
    full = [float(i) for i in range(24)]
    shards = {r: wide.extract(full, r) for r in range(4)}
    # tp rank t stores full rows [2t, 2t+2) and [4+2t, 4+2t+2) of 3 columns, cut at 5
    for rank, shard in shards.items():
        dp, t = divmod(rank, 2)
        local = full[6 * t : 6 * t + 6] + full[12 + 6 * t : 12 + 6 * t + 6]
        assert shard == (local[:5] if dp == 0 else local[5:]), rank
    assert wide.rebuild(shards) == full
