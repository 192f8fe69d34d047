"""Which ranges of the units' master partitions each inner param group steps (stages 0-2).

Communication is planned per unit (`deepshard.zero._resident`); the inner optimizer's param
groups only carry hyper-parameters. So each group's ``params`` become *master views*: for every
parameter of the group, the range of its unit's master partition this rank holds. A unit whose
parameters all belong to one group is stepped as its whole partition (padding included: its
gradient is zero and stays zero under an element-wise update); otherwise consecutive ranges of
one group in one unit are merged across alignment padding. Either is then cut into views of at
most ``view_numel`` elements (`deepshard.zero._flat_params.MASTER_VIEW_NUMEL`). A parameter under
a full-gradient transform (Muon's matrices) gets one view per piece, never merged, so the inner
optimizer can be told its real shape (`deepshard.interface.ParamShapes`).
"""

from __future__ import annotations

from collections.abc import Collection, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from deepshard.interface.errors import ConfigError
from deepshard.zero.layout import FlatLayout

__all__ = ["ViewPlan", "plan_master_views"]


@dataclass(frozen=True)
class ViewPlan:
    """One master view: a range of one unit's master partition, stepped by one param group.

    Attributes:
        unit: The unit.
        lo: First element of the unit's master partition.
        hi: One past the last.
        group: The inner optimizer's param group whose hyper-parameters step it.
        shape: For a piece of a transformed parameter, that parameter's shape; else ``None``.
    """

    unit: int
    lo: int
    hi: int
    group: int
    shape: tuple[int, ...] | None = None


def _group_of(
    param_groups: Sequence[MutableMapping[str, Any]], owned: Collection[int]
) -> dict[int, int]:
    """Each trainable parameter's param group, by ``id``; refuses one no unit owns."""
    group_of: dict[int, int] = {}
    for g, group in enumerate(param_groups):
        for param in group["params"]:
            if not param.requires_grad:
                continue
            if id(param) not in owned:
                raise ConfigError(
                    f"param group {g} holds a parameter of shape {tuple(param.shape)} that is not "
                    "one of the sharded model's trainable parameters; build the inner optimizer "
                    "on the parameters of the module given to deepshard.zero.shard"
                )
            group_of[id(param)] = g
    return group_of


def _cut(plans: list[ViewPlan], max_numel: int | None) -> list[ViewPlan]:
    if max_numel is None:
        return plans
    out = []
    for p in plans:
        if p.shape is not None or p.hi - p.lo <= max_numel:
            out.append(p)
            continue
        for start in range(p.lo, p.hi, max_numel):
            out.append(ViewPlan(p.unit, start, min(start + max_numel, p.hi), p.group))
    return out


def _unit_views(
    u: int,
    params: Sequence[torch.Tensor],
    layout: FlatLayout,
    rank: int,
    group_of: dict[int, int],
    transformed: Collection[int],
) -> list[ViewPlan]:
    groups = {group_of.get(id(p)) for p in params}
    if len(groups) == 1 and None not in groups and not any(id(p) in transformed for p in params):
        (g,) = groups
        assert g is not None  # checked above
        return [ViewPlan(u, 0, layout.partition_numel, g)]
    plans: list[ViewPlan] = []
    for param, slot in zip(params, layout.slots, strict=True):
        g = group_of.get(id(param))
        if g is None:
            continue  # trained by no param group: reduced, never stepped
        for piece in layout.pieces(slot):
            if piece.rank != rank:
                continue
            lo = piece.local_offset
            hi = lo + piece.flat_stop - piece.flat_start
            if id(param) in transformed:
                plans.append(ViewPlan(u, lo, hi, g, slot.shape))
                continue
            last = plans[-1] if plans else None
            if last and last.shape is None and last.group == g and lo - last.hi < layout.alignment:
                plans[-1] = ViewPlan(u, last.lo, hi, g)
            else:
                plans.append(ViewPlan(u, lo, hi, g))
    return plans


def plan_master_views(
    unit_params: Sequence[Sequence[torch.Tensor]],
    layouts: Sequence[FlatLayout],
    rank: int | Sequence[int],
    param_groups: Sequence[MutableMapping[str, Any]],
    transformed: Collection[int],
    view_numel: int | None,
) -> list[ViewPlan]:
    """Every master view of this rank, unit by unit, in partition order.

    Args:
        unit_params: Each unit's trainable parameters, in layout order.
        layouts: Their layouts.
        rank: This rank's partition index (0 when unpartitioned), or one per unit (units
            partitioned over different groups).
        param_groups: The inner optimizer's param groups (not changed).
        transformed: ``id`` of every parameter under the full-gradient transform.
        view_numel: Most elements of an ordinary view; ``None``: one view per merged range.

    Raises:
        ConfigError: A param group holds a trainable parameter that no unit owns.
    """
    owned = {id(p) for params in unit_params for p in params}
    group_of = _group_of(param_groups, owned)
    plans: list[ViewPlan] = []
    ranks = [rank] * len(layouts) if isinstance(rank, int) else list(rank)
    for u, (params, layout) in enumerate(zip(unit_params, layouts, strict=True)):
        views = _unit_views(u, params, layout, ranks[u], group_of, transformed)
        plans += _cut(views, view_numel)
    return plans
