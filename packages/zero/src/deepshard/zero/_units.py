"""Which submodules are stage-3 units and which parameters each owns (a function of the model).

Units are found in ``named_modules()`` order (registration order): the root (the module given
to `deepshard.zero.shard`) and every submodule the policy's rule selects. Each parameter belongs
to the nearest unit above the module that registers it, so a unit owns the parameters of its
module that are not in a sub-unit and the root owns the rest. A parameter registered by several
modules (tied embeddings: ``lm_head.weight is embed_tokens.weight``) belongs to its first owner
in registration order; any other unit whose modules register it *uses* it and gathers the owner
with itself (an *external* unit, as `register_external_parameter` adds by hand).

Each unit's parameters are laid out in one flat buffer by `deepshard.zero.layout` as one bucket
(16-byte aligned parameters, padded to a multiple of ``W × alignment``), so rank ``r``'s
partition is chunk ``r`` of the buffer and one all-gather rebuilds the whole unit. Trainable
parameters come first and frozen ones last, so a rank's trainable elements are a prefix of its
partition (`UnitPlan.trainable_numel`).

**One layout per (unit × reduction group).** When the parameters of one unit name different
reduction groups in their placements (a MoE block: expert weights reduced over ``dp``, the
router and norms over ``dp × ep × sp``), the unit is planned as several `UnitPlan` s on the same
module, one per group in order of first appearance, each laid out over its own group's size.
Each is gathered, released and reduce-scattered over its own group; the module's forward
gathers all of them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from deepshard.interface.errors import ConfigError
from deepshard.zero._policy import ZeroPolicy
from deepshard.zero.layout import FlatLayout, plan_flat_layout

__all__ = ["UnitPlan", "plan_units"]

_ONE_BUCKET = 1 << 62
"""Bucket size that keeps a unit's parameters in one bucket whatever their size."""


@dataclass(frozen=True)
class UnitPlan:
    """One unit of a sharded model.

    Attributes:
        index: Position among the units, in registration order (the root is 0).
        name: The module's qualified name (``""`` for the root).
        module: The module whose forward gathers the unit.
        param_names: Qualified names of the parameters it owns: the trainable ones, then the
            frozen ones, each in registration order.
        params: Those parameters.
        layout: Their flat layout over the data-parallel group.
        external: Indices of the units owning parameters its modules use but do not own.
        reduce_over: The mesh axes its parameters are partitioned and reduced over (``()``:
            the one group `deepshard.zero.shard` was given).
    """

    index: int
    name: str
    module: torch.nn.Module
    param_names: tuple[str, ...]
    params: tuple[torch.nn.Parameter, ...]
    layout: FlatLayout
    external: tuple[int, ...]
    reduce_over: tuple[str, ...] = ()

    @property
    def numel(self) -> int:
        """Elements of the unit's parameters (without padding)."""
        return sum(slot.numel for slot in self.layout.slots)

    def trainable_numel(self, rank: int) -> int:
        """Length of the prefix of ``rank``'s partition holding trainable parameters (the rest
        is frozen parameters and padding)."""
        trainable = [
            s.stop for s, p in zip(self.layout.slots, self.params, strict=True) if p.requires_grad
        ]
        chunk = self.layout.partition_numel
        end = max(trainable, default=0)
        return min(chunk, max(0, end - rank * chunk))

    @property
    def dtype(self) -> torch.dtype:
        """The dtype its parameters share (float32 for a unit without parameters)."""
        return self.params[0].dtype if self.params else torch.float32


def _default_units(module: torch.nn.Module) -> set[int]:
    """Ids of the modules the default rule makes units (see `deepshard.zero.ZeroPolicy`)."""
    names = set(getattr(module, "_no_split_modules", None) or ())
    if names:
        return {id(m) for m in module.modules() if type(m).__name__ in names and m is not module}
    lists = [m for m in module.modules() if isinstance(m, torch.nn.ModuleList)]
    return {id(child) for lst in lists for child in lst.children()}


def _unit_of_modules(module: torch.nn.Module, policy: ZeroPolicy) -> dict[str, str]:
    """Each module's name → the name of the nearest unit at or above it."""
    defaults = _default_units(module)
    owner: dict[str, str] = {}
    for name, sub in module.named_modules():
        parent = name.rpartition(".")[0] if name else ""
        is_unit = bool(name) and policy.is_unit(name, sub, default=id(sub) in defaults)
        owner[name] = name if not name or is_unit else owner[parent]
    return owner


def plan_units(
    module: torch.nn.Module,
    policy: ZeroPolicy,
    *,
    world_size: int,
    shapes: Mapping[int, tuple[int, ...]] | None = None,
    bucket_numel: int = _ONE_BUCKET,
    trainable_only: bool = False,
    reduce_over: Mapping[str, tuple[str, ...]] | None = None,
    world_of: Callable[[tuple[str, ...]], int] | None = None,
) -> tuple[UnitPlan, ...]:
    """The units of ``module`` under ``policy`` and their flat layouts over ``world_size`` ranks.

    Units that own no parameter are left out, except the root (index 0), which always exists.
    ``shapes`` gives the full shape of parameters (by ``id``) whose ``.data`` is not whole
    (partitioned by `deepshard.zero.Init`); the others' own shapes are used.

    Stage 3 keeps each unit in one bucket (one all-gather rebuilds it). Stages 0-2 pass
    ``bucket_numel`` (``reduce_bucket_size``, capped on CPU) so a unit's gradients are reduced
    in buckets as they become ready, and ``trainable_only``: frozen parameters then belong to
    no unit and keep their own storage (nothing is gathered or reduced for them).

    ``reduce_over`` (parameter name → reduction axes) splits a unit whose parameters name
    several groups into one plan per group; ``world_of`` gives each group's size (its layout's
    ``world_size``; ``world_size`` when omitted).

    Raises:
        ConfigError: A unit's parameters mix dtypes or devices.
    """
    owner_of_module = _unit_of_modules(module, policy)
    axes_of = reduce_over or {}
    units: dict[tuple[str, tuple[str, ...]], list[tuple[str, torch.nn.Parameter]]] = {}
    units.update({(name, ()): [] for name in dict.fromkeys(owner_of_module.values())})
    uses: dict[str, set[int]] = {name: set() for name, _ in units}
    owner_of_param: dict[int, tuple[str, tuple[str, ...]]] = {}
    for mod_name, sub in module.named_modules():
        unit = owner_of_module[mod_name]
        for p_name, param in sub.named_parameters(recurse=False):
            full = f"{mod_name}.{p_name}" if mod_name else p_name
            if trainable_only and not param.requires_grad:
                continue
            if id(param) not in owner_of_param:
                key = (unit, axes_of.get(full, ()))
                owner_of_param[id(param)] = key
                units.setdefault(key, []).append((full, param))
            elif owner_of_param[id(param)][0] != unit:
                uses[unit].add(id(param))
    order = sorted(units, key=_unit_order(list(uses)))
    kept = [key for key in order if units[key] or key == ("", ())]
    index = {key: i for i, key in enumerate(kept)}
    modules = dict(module.named_modules())
    plans = []
    for key in kept:
        name, axes = key
        # Trainable first: the frozen parameters fill the end of the layout, so each rank's
        # trainable elements are a prefix of its partition and only that prefix gets an fp32
        # master (`deepshard.zero._stage3_optimizer`).
        params = sorted(units[key], key=lambda named: not named[1].requires_grad)
        external = sorted({index[owner_of_param[pid]] for pid in uses[name]})
        world = world_of(axes) if world_of is not None and axes else world_size
        plans.append(
            UnitPlan(
                index[key],
                name,
                modules[name],
                tuple(n for n, _ in params),
                tuple(p for _, p in params),
                _layout(name, [p for _, p in params], world, shapes or {}, bucket_numel),
                tuple(external),
                axes,
            )
        )
    return tuple(plans)


def _unit_order(
    names: list[str],
) -> Callable[[tuple[str, tuple[str, ...]]], tuple[int, int]]:
    """Sort key of ``(unit name, axes)``: registration order of the unit, then ``()`` first."""
    position = {name: i for i, name in enumerate(names)}
    return lambda key: (position[key[0]], 0 if not key[1] else 1)


def _layout(
    name: str,
    params: list[torch.nn.Parameter],
    world_size: int,
    shapes: Mapping[int, tuple[int, ...]],
    bucket_numel: int,
) -> FlatLayout:
    kinds = {(p.dtype, p.device) for p in params}
    if len(kinds) > 1:
        raise ConfigError(
            f"ZeRO unit {name or '<root>'!r} mixes parameter dtypes/devices "
            f"{sorted(map(str, kinds))}; cast and move the model to one dtype and device "
            "before deepshard.zero.shard"
        )
    if any(not p.is_floating_point() for p in params):
        raise ConfigError(
            f"ZeRO unit {name or '<root>'!r} has non-float parameters; register them as "
            "buffers instead"
        )
    element_size = params[0].element_size() if params else 4
    return plan_flat_layout(
        [shapes.get(id(p), tuple(p.shape)) for p in params],
        element_size=element_size,
        world_size=world_size,
        bucket_numel=bucket_numel,
    )
