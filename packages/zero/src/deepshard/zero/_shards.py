"""Shard maps of the master weights: which rank holds which elements of each parameter.

This is what the checkpoint package reads. Each trainable parameter gets a
`deepshard.interface.ShardMap` over ZeRO's data-parallel group, derived from the parameter's
placement (`deepshard.zero._placements`): the box of the global tensor its holder keeps (the
whole tensor for a plain model, a slice under tensor parallelism), then the flat range of that
box the holder's fp32 master partition covers, with ``local_offset``, where that range starts in
the master partition of the parameter's param group. A fused tensor-parallel weight
(``Shard(dim, parts)``) is several boxes stored back to back; a flat range then becomes one
piece per box it meets, each with its own range of that box and its own local offset. Every
piece carries its holder's coordinate on each mesh axis. At stage 0 every rank holds every
parameter whole (the map is replicated over the group); at stages 1-2 the masters' placement
marks the reduction axes `deepshard.interface.FlatShard`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from deepshard.interface import FlatShard, ParamPlacement, ShardMap, ShardPiece
from deepshard.zero._placements import GroupPlacements
from deepshard.zero.layout import FlatLayout, ParamSlot

__all__ = ["ParamShard", "param_shards"]


@dataclass(frozen=True)
class ParamShard:
    """One trainable parameter's place in the partitioned masters.

    Attributes:
        name: The parameter's name (from ``named_parameters``), else
            ``param_groups.<g>.params.<i>`` (its position among the group's trainable ones).
        group_index: The param group whose master partition ``local_offset`` refers to.
        shard_map: The pieces every rank of the data-parallel group holds (fp32).
        placement: The masters' placement: the parameter's own, in fp32, with `FlatShard` on
            the reduction axes when they are partitioned (stages 1-2).
    """

    name: str
    group_index: int
    shard_map: ShardMap
    placement: ParamPlacement


def _spans(layout: FlatLayout, slot: ParamSlot, group_size: int) -> list[tuple[int, ...]]:
    """``(group rank, flat_start, flat_stop, local_offset)`` of every holder of ``slot``."""
    if slot.numel == 0:
        return []
    if layout.world_size == 1:  # replicated: every rank holds the whole partition
        return [(r, 0, slot.numel, slot.offset) for r in range(group_size)]
    return [(p.rank, p.flat_start, p.flat_stop, p.local_offset) for p in layout.pieces(slot)]


def _box_pieces(
    boxes: Sequence[tuple[tuple[int, ...], tuple[int, ...]]],
    rank: int,
    span: tuple[int, int, int],
    coords: tuple[int, ...],
) -> list[ShardPiece]:
    """The pieces of one holder's flat range ``[start, stop)`` of its local tensor, which is
    ``boxes`` back to back: one piece per box the range meets (the range itself, for one box).

    ``span`` is ``(start, stop, local_offset)``; each piece's flat range is relative to its box
    and its local offset moves on by the elements before it."""
    start, stop, local = span
    if len(boxes) == 1:
        offset, box = boxes[0]
        return [ShardPiece(rank, offset, box, start, stop, local, coords)]
    pieces, base = [], 0
    for offset, box in boxes:
        size = math.prod(box)
        lo, hi = max(start, base), min(stop, base + size)
        if lo < hi:
            piece = ShardPiece(rank, offset, box, lo - base, hi - base, local + lo - start, coords)
            pieces.append(piece)
        base += size
    return pieces


def _shard_map(
    layout: FlatLayout, slot: ParamSlot, placement: ParamPlacement, where: GroupPlacements
) -> ShardMap:
    topology = where.topology
    pieces = []
    for rank, start, stop, local in _spans(layout, slot, len(where.member_coords)):
        coords = where.member_coords[rank]
        boxes = placement.local_boxes(topology, dict(zip(topology.axis_names, coords, strict=True)))
        pieces += _box_pieces(boxes, rank, (start, stop, local), coords)
    return ShardMap(
        placement.global_shape,
        "float32",
        tuple(pieces),
        where.axes,
        topology.axis_names,
        topology.shape,
    )


def _master_placement(
    placement: ParamPlacement, axes: Sequence[str], partitioned: bool
) -> ParamPlacement:
    masters = replace(placement, dtype="float32")
    for axis in axes if partitioned else ():
        masters = masters.with_axis(axis, FlatShard())
    return masters


def param_shards(
    layouts: Sequence[FlatLayout],
    names: Sequence[Sequence[str]],
    where: GroupPlacements,
) -> tuple[ParamShard, ...]:
    """Every trainable parameter's `ParamShard`, group by group.

    Args:
        layouts: The layouts of the param groups.
        names: Parameter names per group, in layout order.
        where: The parameters' placements and the group members' coordinates.
    """
    shards = []
    for g, layout in enumerate(layouts):
        for name, slot in zip(names[g], layout.slots, strict=True):
            placement = where.placements[g][slot.index]
            shard_map = _shard_map(layout, slot, placement, where)
            masters = _master_placement(placement, where.axes, layout.world_size > 1)
            shards.append(ParamShard(name, g, shard_map, masters))
    return tuple(shards)
