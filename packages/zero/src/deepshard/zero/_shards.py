"""Shard maps of the master weights: which rank holds which elements of each parameter.

This is what the checkpoint package reads. Each trainable parameter gets a
`deepshard.interface.ShardMap` over the data-parallel group, with one piece per rank holding
part of it: the flat range of the parameter (row-major) and ``local_offset``, where that range
starts in the rank's fp32 master partition of the parameter's param group. At stage 0 every rank
holds every parameter whole (the map is replicated).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from deepshard.interface import ShardMap, ShardPiece
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
    """

    name: str
    group_index: int
    shard_map: ShardMap


def _pieces(layout: FlatLayout, slot: ParamSlot, group_size: int) -> tuple[ShardPiece, ...]:
    shape = slot.shape
    origin = tuple(0 for _ in shape)
    if slot.numel == 0:
        return ()
    if layout.world_size == 1:  # replicated: every rank holds the whole partition
        return tuple(
            ShardPiece(r, origin, shape, 0, slot.numel, slot.offset) for r in range(group_size)
        )
    return tuple(
        ShardPiece(p.rank, origin, shape, p.flat_start, p.flat_stop, p.local_offset)
        for p in layout.pieces(slot)
    )


def param_shards(
    params: Sequence[Sequence[torch.Tensor]],
    layouts: Sequence[FlatLayout],
    group_size: int,
    names: Mapping[int, str],
    axes: tuple[str, ...],
) -> tuple[ParamShard, ...]:
    """Every trainable parameter's `ParamShard`, group by group.

    Args:
        params: Trainable parameters per group, in layout order.
        layouts: Their layouts.
        group_size: Ranks in the data-parallel group.
        names: Parameter name by ``id(param)``.
        axes: Mesh axes of the data-parallel group.
    """
    shards = []
    for g, (group_params, layout) in enumerate(zip(params, layouts, strict=True)):
        for param, slot in zip(group_params, layout.slots, strict=True):
            name = names.get(id(param), f"param_groups.{g}.params.{slot.index}")
            pieces = _pieces(layout, slot, group_size)
            shards.append(ParamShard(name, g, ShardMap(slot.shape, "float32", pieces, axes)))
    return tuple(shards)
