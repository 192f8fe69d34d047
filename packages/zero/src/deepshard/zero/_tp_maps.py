"""Shard maps of a tensor-parallel model's ZeRO state over the whole data-parallel × ``tp`` grid.

ZeRO's own maps (`deepshard.zero._shards`) cover one data-parallel group: the ranks that share
this rank's ``tp`` coordinate, each piece the holder's box of the global tensor (its TP slice)
and a flat range of that box (its ZeRO partition). A checkpoint of the whole model needs every
TP slice in one map. The ranks of one tensor-parallel group lay their units out identically
(equal local shapes), so the pieces held at ``tp`` coordinate ``t`` are this group's pieces with
``t`` put in their coordinates and the box recomputed from the placement
(`ParamPlacement.local_boxes`: the box in the same place of the holder's storage, for a fused
weight stored as several); a replicated parameter simply gets equal boxes at every ``t``
(replicas of the same bytes). The widened map spans the reduction axes plus ``tp``, so its
rank is the holder's index in that grid, row-major in mesh order: with ``pp = 1`` its global
rank. No communication is needed.

The same widening serves expert parameters at stage 3 (`expert_widened_entries`): their ZeRO
group is ``dp`` and the ranks along ``ep`` hold the other experts with equal local shapes, so
the pieces at ``ep`` coordinate ``e`` are this group's with ``e`` put in and the box cut from
the placement's ``Shard(0)`` on ``ep``; the widened map spans the dense group's axes, its ranks
that group's.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace

from deepshard.interface import ParamPlacement, ShardMap, ShardPiece, Topology
from deepshard.interface.errors import CheckpointError
from deepshard.zero._state_entry import StateShard

__all__ = ["expert_widened_entries", "widen_over_axis", "widen_over_tp", "widened_entries"]


def widen_over_tp(
    shard_map: ShardMap, placement: ParamPlacement | None, topology: Topology
) -> ShardMap:
    """``shard_map`` (over a data-parallel group) extended to every ``tp`` coordinate
    (`widen_over_axis` with ``tp``)."""
    return widen_over_axis(shard_map, placement, topology, "tp")


def widen_over_axis(
    shard_map: ShardMap, placement: ParamPlacement | None, topology: Topology, axis: str
) -> ShardMap:
    """``shard_map`` (over a data-parallel group) extended to every coordinate of ``axis``.

    ``tp`` for a tensor-parallel model; ``ep`` for expert parameters, whose ZeRO group is
    ``dp`` while the ``ep`` ranks hold the other experts (`deepshard.zero._rgroups`).

    Args:
        shard_map: A map naming the mesh (pieces carry coordinates), over axes without ``axis``.
        placement: The tensor's placement (how ``axis`` splits it); ``None`` for a tensor with
            the same box everywhere (a scalar).
        topology: The mesh's axis sizes.
        axis: The mesh axis to widen over.

    Raises:
        CheckpointError: The map names no mesh, or already spans ``axis``.
    """
    names = topology.axis_names
    if shard_map.mesh_axes != names or axis in shard_map.axes:
        raise CheckpointError(
            f"cannot widen a shard map over axes {shard_map.axes} on mesh {shard_map.mesh_axes} "
            f"to {axis}: it must name the mesh {names} and leave {axis} out"
        )
    axes = tuple(a for a in names if a in shard_map.axes or a == axis)
    sizes = dict(zip(names, topology.shape, strict=True))
    at = names.index(axis)
    pieces = []
    for t in range(sizes[axis]):
        for piece in shard_map.pieces:
            coords = (*piece.coords[:at], t, *piece.coords[at + 1 :])
            named = dict(zip(names, coords, strict=True))
            rank = 0
            for name in axes:
                rank = rank * sizes[name] + named[name]
            offset, box = (
                (piece.box_offset, piece.box_shape)
                if placement is None
                else _same_box(placement, topology, piece, named)
            )
            pieces.append(
                replace(piece, rank=rank, box_offset=offset, box_shape=box, coords=coords)
            )
    return replace(shard_map, pieces=tuple(pieces), axes=axes)


def _same_box(
    placement: ParamPlacement, topology: Topology, piece: ShardPiece, coords: dict[str, int]
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The box at ``coords`` that stands where ``piece``'s box stands in its holder's storage
    (the only one, unless a fused split makes the local tensor several boxes)."""
    own = dict(zip(topology.axis_names, piece.coords, strict=True))
    mine = placement.local_boxes(topology, own)
    theirs = placement.local_boxes(topology, coords)
    if len(mine) == 1:
        return theirs[0]
    return theirs[mine.index((piece.box_offset, piece.box_shape))]


def expert_widened_entries(
    entries: Sequence[StateShard], placements: Mapping[str, ParamPlacement]
) -> tuple[StateShard, ...]:
    """Expert entries' maps (over ``dp``) widened over ``ep``, so that every entry's map spans
    the dense data-parallel group and its ranks are that group's (one checkpoint holds every
    rank's experts); dense and scalar entries are returned as they are.

    Args:
        entries: Stage-3 `state_shards` entries of a model with several reduction groups.
        placements: The masters' placement of every parameter, by name.
    """
    if not entries:
        return ()
    smap = entries[0].shard_map
    topology = Topology(**dict(zip(smap.mesh_axes, smap.mesh_shape, strict=True)))
    widest = max(len(e.shard_map.axes) for e in entries)
    return tuple(
        replace(
            entry,
            shard_map=widen_over_axis(entry.shard_map, placements.get(entry.name), topology, "ep"),
        )
        if len(entry.shard_map.axes) < widest and "ep" not in entry.shard_map.axes
        else entry
        for entry in entries
    )


def widened_entries(
    entries: Sequence[StateShard], placements: Mapping[str, ParamPlacement]
) -> tuple[StateShard, ...]:
    """Every entry with its map widened over ``tp`` (`widen_over_tp`); scalars keep their box.

    Args:
        entries: `ZeroOptimizer.state_shards`'s entries over the data-parallel group (their
            maps name the mesh).
        placements: The masters' placement of every parameter, by name.
    """
    if not entries:
        return ()
    smap = entries[0].shard_map
    topology = Topology(**dict(zip(smap.mesh_axes, smap.mesh_shape, strict=True)))
    return tuple(
        replace(
            entry,
            shard_map=widen_over_tp(entry.shard_map, placements.get(entry.name), topology),
        )
        for entry in entries
    )
