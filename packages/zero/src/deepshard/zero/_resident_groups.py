"""Stages 0-2 over several reduction groups: each unit's group, shard maps, norm and refresh.

A `ResidentModule` whose placements name several reduction groups (a MoE model: expert
weights reduced over ``dp``, everything else over ``dp × ep × sp``) has one layout per
(unit × group), each planned over its own group (`deepshard.zero._resident.build_resident`).
Then every bucket is reduced over its layout's group (all-reduced at stage 0, reduce-scattered
at stages 1-2: the stage semantics per group), the fp32 masters of a layout are partitioned
over its group, and the updated partitions are all-gathered over it after the step.

**The gradient norm** follows the stage-3 argument (`deepshard.zero._rgroups`): when each
element of a layout sits in exactly one rank's share within the layout's group, the dense
group's ranks together hold every distinct element once (the ``ep`` ranks hold other experts),
so one all-reduce of the summed local ``Σ|g|^p`` over the dense group is the global norm.
Stages 1-2 partition every layout, so the shares are the partitions. At stage 0 every rank of
a group holds the whole reduced gradient, so each rank counts only its group rank's contiguous
``1/W`` slice of every layout (`norm_inputs`): still one collective, every element once.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from deepshard.comm import CommsLogger
from deepshard.zero._flat_params import FlatParams
from deepshard.zero._placements import resolve_placements
from deepshard.zero._resident import ResidentModule
from deepshard.zero._shards import ParamShard, param_shards
from deepshard.zero.layout import GatherCall

__all__ = ["norm_inputs", "refresh_units", "unit_shards"]


def unit_shards(resident: ResidentModule) -> tuple[ParamShard, ...]:
    """Every trainable parameter's `ParamShard`, unit by unit, each over its unit's group.

    Raises:
        TopologyError: As `deepshard.zero._placements.resolve_placements`, per group.
    """
    params, names = resident.params, resident.names
    layouts = [u.flat.layout for u in resident.units]
    by_group: dict[int, list[int]] = {}
    for u, unit in enumerate(resident.units):
        by_group.setdefault(id(unit.group), []).append(u)
    found: dict[tuple[int, int], ParamShard] = {}
    for units in by_group.values():
        group = resident.units[units[0]].group
        picked = ([params[u] for u in units], [names[u] for u in units])
        where = resolve_placements(group, *picked, resident.placements)
        shards = iter(param_shards([layouts[u] for u in units], picked[1], where))
        for u in units:
            found.update(((u, i), _reindexed(next(shards), u)) for i in range(len(names[u])))
    return tuple(found[(u, i)] for u in range(len(names)) for i in range(len(names[u])))


def _reindexed(shard: ParamShard, unit: int) -> ParamShard:
    """``shard`` naming its unit's index among all units (not among its group's)."""
    return ParamShard(shard.name, unit, shard.shard_map, shard.placement)


def norm_inputs(
    resident: ResidentModule, grads: Sequence[torch.Tensor]
) -> tuple[list[torch.Tensor], torch.distributed.ProcessGroup | None]:
    """The tensors whose norm this rank adds, and the group summing them (``None``: none).

    With one group: the gradient partitions, summed over the group when partitioned. With
    several: the dense group always sums, and at stage 0 each rank adds only its group rank's
    slice of every layout's whole gradient (the module note).
    """
    if not resident.mixed_groups:
        return list(grads), (resident.group if resident.partition_count > 1 else None)
    if resident.policy.stage >= 1:
        return list(grads), resident.group
    shares = []
    for unit, grad in zip(resident.units, grads, strict=True):
        size, rank = unit.group.size(), unit.group.rank()
        step = -(-grad.numel() // size)
        shares.append(grad[rank * step : (rank + 1) * step])
    return shares, resident.group


def refresh_units(
    resident: ResidentModule,
    masters: Sequence[torch.Tensor],
    calls: Sequence[Sequence[GatherCall]],
    logger: CommsLogger | None,
) -> None:
    """Write the updated masters into the parameters: copied (stage 0) or all-gathered over
    each unit's own group (stages 1-2)."""
    for u, (unit, master) in enumerate(zip(resident.units, masters, strict=True)):
        flat: FlatParams = unit.flat
        if resident.unit_partition_count(u) == 1:
            flat.copy_from(master)
        else:
            flat.gather_from(master, calls[u], group=unit.group, logger=logger)
