"""`ShardInfo`: what a stage-3 parameter is, while its ``.data`` is an empty tensor.

A released parameter has zero elements, so its real shape, dtype and this rank's part of it
are held here, in DeepShard's own objects (never as attributes on the parameter), together with
the `deepshard.interface.ShardMap` of its fp32 masters (derived from its placement, as at stages
0-2), which Muon and the checkpoint package read.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from deepshard.interface import PlacementRegistry
from deepshard.zero._placements import resolve_placements
from deepshard.zero._shards import ParamShard, param_shards
from deepshard.zero._units import UnitPlan

__all__ = ["ShardInfo", "build_shard_infos"]


@dataclass(frozen=True)
class ShardInfo:
    """One stage-3 parameter as a whole and this rank's part of it.

    Attributes:
        name: Its qualified name (its first name when tied).
        unit: Index of the unit that owns it.
        shape: The full shape.
        dtype: Its dtype.
        flat_start: First element (row-major) of the parameter this rank's partition holds.
        flat_stop: One past the last; equal to ``flat_start`` when this rank holds none.
        local_offset: Where that range starts in this rank's partition of the unit.
        shard: Its `ParamShard`: the `deepshard.interface.ShardMap` of the masters over the
            data-parallel group and their placement.
    """

    name: str
    unit: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    flat_start: int
    flat_stop: int
    local_offset: int
    shard: ParamShard

    @property
    def numel(self) -> int:
        """Elements of the full parameter."""
        return int(torch.Size(self.shape).numel())

    @property
    def local_numel(self) -> int:
        """Elements this rank holds."""
        return self.flat_stop - self.flat_start


def build_shard_infos(
    plans: Sequence[UnitPlan],
    groups: Sequence[torch.distributed.ProcessGroup],
    placements: PlacementRegistry | None,
) -> dict[int, ShardInfo]:
    """Every owned parameter's `ShardInfo`, keyed by ``id(param)``; call before releasing.

    ``groups[i]`` is the group unit ``i`` is partitioned over; each parameter's map covers
    its own group's ranks (placements resolved group by group).

    Raises:
        TopologyError: As `deepshard.zero._placements.resolve_placements`.
    """
    infos: dict[int, ShardInfo] = {}
    for group in dict.fromkeys(groups):
        mine = [plan for plan, g in zip(plans, groups, strict=True) if g is group]
        infos.update(_group_infos(mine, group, placements))
    return infos


def _group_infos(
    plans: Sequence[UnitPlan],
    group: torch.distributed.ProcessGroup,
    placements: PlacementRegistry | None,
) -> dict[int, ShardInfo]:
    # Shape stand-ins: the parameters themselves may be partitioned already (`Init`).
    params = [
        [torch.empty(slot.shape, dtype=p.dtype, device="meta") for slot in p.layout.slots]
        for p in plans
    ]
    names = [list(p.param_names) for p in plans]
    where = resolve_placements(group, params, names, placements)
    shards = iter(param_shards([p.layout for p in plans], names, where))
    rank = group.rank()
    infos: dict[int, ShardInfo] = {}
    for plan in plans:
        for name, param, slot in zip(plan.param_names, plan.params, plan.layout.slots, strict=True):
            shard = replace(next(shards), group_index=plan.index)
            mine = [piece for piece in plan.layout.pieces(slot) if piece.rank == rank]
            start, stop, local = (
                (mine[0].flat_start, mine[0].flat_stop, mine[0].local_offset) if mine else (0, 0, 0)
            )
            infos[id(param)] = ShardInfo(
                name, plan.index, slot.shape, plan.dtype, start, stop, local, shard
            )
    return infos
