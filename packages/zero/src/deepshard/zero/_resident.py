"""ZeRO stages 0-2's model side: every unit resident, its flat layout cut into buckets.

At stages 0-2 every rank holds the whole model, so nothing is gathered or released around a
forward. ``shard(module, policy=ZeroPolicy(stage=k))`` with ``k < 3`` still cuts the model into
the units stage 3 uses (`deepshard.zero._units`: ``_no_split_modules`` blocks, ``ModuleList``
children, the root for the rest), but keeps only the trainable parameters (frozen ones keep
their own storage: nothing is reduced for them) and lays each unit out in one flat buffer cut
into buckets of whole parameters of at most ``reduce_bucket_size`` elements (4M on CPU,
`deepshard.zero._settings`). Each parameter's ``.data`` is re-pointed at its slot of its unit's
buffer (`deepshard.zero._flat_params.FlatParams`) and stays there.

Those buckets are the communication units of the optimizer side (`deepshard.zero.ZeroOptimizer`
given this module): stage 2 reduce-scatters each bucket as soon as its gradients are ready,
stage 1 reduce-scatters and stage 0 all-reduces them in the boundary pass, and stages 1-2
all-gather the updated partitions back into the buffers after the step. So communication is
planned per unit, and the optimizer's param groups only say which hyper-parameters step which
master views (`deepshard.zero._master_views`).

The params-only constructor ``ZeroOptimizer(inner, group=...)`` builds the same object from the
inner optimizer's param groups, one unit per group (`resident_from_param_groups`).

Placements naming several reduction groups (expert weights over ``dp``) give a unit one layout
per group, each over its own group (`ResidentUnit.group`), as at stage 3; how the optimizer side
reduces, partitions and takes the norm over them is `deepshard.zero._resident_groups`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from deepshard.comm import CommsLogger
from deepshard.interface import PlacementRegistry
from deepshard.interface.config import ZeroConfig
from deepshard.interface.errors import ConfigError
from deepshard.zero._flat_params import FlatParams, common_dtype_and_device
from deepshard.zero._placements import registration_positions
from deepshard.zero._policy import ZeroPolicy
from deepshard.zero._rgroups import axes_of
from deepshard.zero._settings import message_numel
from deepshard.zero._tp import tp_group_for
from deepshard.zero._units import plan_units
from deepshard.zero.layout import FlatLayout, plan_flat_layout

__all__ = [
    "ResidentModule",
    "ResidentUnit",
    "build_resident",
    "model_side_problems",
    "resident_from_param_groups",
    "sharded_section",
]


@dataclass(frozen=True)
class ResidentUnit:
    """One unit's trainable parameters, re-pointed into its flat buffer.

    Attributes:
        name: The unit's module name (``""`` for the root), or ``param_groups.<g>``.
        param_names: The parameters' qualified names, in layout order.
        params: The parameters, in layout order.
        flat: Their flat buffer and its bucketed layout.
        group: The group its gradients are reduced (and, at stages 1-2, its masters
            partitioned) over: the dense group, or its parameters' own reduction group.
        reduce_over: The mesh axes of that group (``()``: the dense group ``shard`` got).
    """

    name: str
    param_names: tuple[str, ...]
    params: tuple[torch.nn.Parameter, ...]
    flat: FlatParams
    group: torch.distributed.ProcessGroup
    reduce_over: tuple[str, ...] = ()

    @property
    def layout(self) -> FlatLayout:
        """The unit's flat layout over the partition group."""
        return self.flat.layout


@dataclass(frozen=True)
class ResidentModule:
    """A model at ZeRO stage 0-2 (build with `deepshard.zero.shard`): its resident units.

    Attributes:
        module: The model (``None`` when built from param groups).
        units: The units, root first (`deepshard.zero._units` order).
        group: The data-parallel group gradients are reduced over.
        policy: The knobs (stage, bucket sizes, reduction, ``overlap_comm``...).
        comms_logger: Records the collectives the optimizer side issues.
        placements: Every parameter's placement by name; ``None``: whole on every rank.
        param_positions: Each unit's parameters' registration positions (the order buckets
            are reduced in), or ``None`` when not every parameter is named.
        device: Where the parameters live.
        tp_group: The tensor-parallel group when the placements shard over ``tp`` (the step
            combines the norm over it, `deepshard.zero._tp`); ``None`` otherwise.
    """

    module: torch.nn.Module | None
    units: tuple[ResidentUnit, ...]
    group: torch.distributed.ProcessGroup
    policy: ZeroPolicy
    comms_logger: CommsLogger | None
    placements: PlacementRegistry | None
    param_positions: tuple[tuple[int, ...], ...] | None
    device: torch.device
    tp_group: torch.distributed.ProcessGroup | None = None

    @property
    def partition_count(self) -> int:
        """Partitions per unit: the group's size at stages 1-2, 1 at stage 0."""
        return self.group.size() if self.policy.stage >= 1 else 1

    @property
    def partition_rank(self) -> int:
        """This rank's partition (0 at stage 0)."""
        return self.group.rank() if self.policy.stage >= 1 else 0

    @property
    def mixed_groups(self) -> bool:
        """Whether some unit is reduced over another group than `group` (expert parameters)."""
        return any(u.group is not self.group for u in self.units)

    def unit_partition_count(self, unit: int) -> int:
        """Partitions of unit ``unit``: its group's size at stages 1-2, 1 at stage 0."""
        return self.units[unit].group.size() if self.policy.stage >= 1 else 1

    def unit_partition_rank(self, unit: int) -> int:
        """This rank's partition of unit ``unit`` (0 at stage 0)."""
        return self.units[unit].group.rank() if self.policy.stage >= 1 else 0

    @property
    def partition_ranks(self) -> list[int]:
        """This rank's partition of every unit (`unit_partition_rank`), in unit order."""
        return [self.unit_partition_rank(u) for u in range(len(self.units))]

    @property
    def gather_numel(self) -> int:
        """Most elements of one all-gather after the step (capped on CPU)."""
        return message_numel(self.policy.allgather_bucket_size, self.device)

    @property
    def params(self) -> list[list[torch.nn.Parameter]]:
        """Each unit's trainable parameters, in layout order."""
        return [list(u.params) for u in self.units]

    @property
    def names(self) -> tuple[tuple[str, ...], ...]:
        """Each unit's parameter names, in layout order."""
        return tuple(u.param_names for u in self.units)


def build_resident(
    module: torch.nn.Module,
    group: torch.distributed.ProcessGroup,
    policy: ZeroPolicy,
    placements: PlacementRegistry | None,
    comms_logger: CommsLogger | None,
    tp_group: torch.distributed.ProcessGroup | None = None,
    groups: Mapping[tuple[str, ...], torch.distributed.ProcessGroup] | None = None,
) -> ResidentModule:
    """`deepshard.zero.shard` at stages 0-2: plan the units, move each into its buffer.

    ``groups`` (reduction axes → process group, `deepshard.zero._rgroups.reduction_groups`)
    gives a unit whose parameters name one of them a layout of its own over that group, as at
    stage 3 (one layout per unit × reduction group).

    Raises:
        ConfigError: A unit mixes dtypes or devices, or holds non-float parameters.
    """
    trainable = [p for p in module.parameters() if p.requires_grad]
    device = trainable[0].device if trainable else torch.device("cpu")
    devices = {p.device for p in trainable}
    if len(devices) > 1:
        raise ConfigError(
            f"the model's parameters live on several devices {sorted(map(str, devices))}; ZeRO "
            "needs the whole model on one device (move it before deepshard.zero.shard)"
        )
    groups = dict(groups or {})
    partitioned = policy.stage >= 1
    plans = plan_units(
        module,
        policy,
        world_size=group.size() if partitioned else 1,
        bucket_numel=message_numel(policy.reduce_bucket_size, device),
        trainable_only=True,
        reduce_over=axes_of(module, placements, groups),
        world_of=lambda axes: groups[axes].size() if partitioned else 1,
    )
    kept = [plan for plan in plans if plan.params] or list(plans[:1])
    units = tuple(
        ResidentUnit(
            plan.name,
            plan.param_names,
            plan.params,
            FlatParams(plan.params, plan.layout, plan.dtype, device),
            groups[plan.reduce_over] if plan.reduce_over else group,
            plan.reduce_over,
        )
        for plan in kept
    )
    named = list(module.named_parameters())
    positions = registration_positions([u.params for u in units], named)
    return ResidentModule(
        module, units, group, policy, comms_logger, placements, positions, device, tp_group
    )


def resident_from_param_groups(
    param_groups: Sequence[MutableMapping[str, Any]],
    group: torch.distributed.ProcessGroup,
    policy: ZeroPolicy,
    comms_logger: CommsLogger | None,
    named_parameters: Iterable[tuple[str, torch.Tensor]] = (),
    placements: PlacementRegistry | None = None,
) -> ResidentModule:
    """The `ResidentModule` of a model known only by its optimizer: one unit per param group.

    Args:
        param_groups: The inner optimizer's param groups (not changed).
        group: The data-parallel group.
        policy: The knobs (stage, bucket sizes...).
        comms_logger: Records the collectives.
        named_parameters: ``model.named_parameters()``: names and the registration order
            (reverse buffer order without them).
        placements: Every parameter's placement by name.

    Raises:
        ConfigError: A parameter listed twice, a group mixing dtypes or devices, non-float
            parameters, or groups on different devices.
    """
    _check_unique(param_groups)
    tp_group_for(placements, None)  # tensor parallelism needs shard(parallel_dims=): refused
    named = list(named_parameters)
    names = {id(param): name for name, param in named}
    world = group.size() if policy.stage >= 1 else 1
    trainable_groups = [[p for p in g["params"] if p.requires_grad] for g in param_groups]
    kinds = [common_dtype_and_device(ps, g) for g, ps in enumerate(trainable_groups)]
    devices = {device for (_, device), ps in zip(kinds, trainable_groups, strict=True) if ps}
    if len(devices) > 1:
        raise ConfigError(
            f"the param groups live on several devices {sorted(map(str, devices))}; ZeRO needs "
            "the whole model on one device"
        )
    device = devices.pop() if devices else torch.device("cpu")
    bucket = message_numel(policy.reduce_bucket_size, device)
    units = []
    for g, (params, (dtype, _)) in enumerate(zip(trainable_groups, kinds, strict=True)):
        layout = plan_flat_layout(
            [tuple(p.shape) for p in params],
            element_size=dtype.itemsize,
            world_size=world,
            bucket_numel=bucket,
        )
        unit_names = tuple(
            names.get(id(p), f"param_groups.{g}.params.{i}") for i, p in enumerate(params)
        )
        flat = FlatParams(params, layout, dtype, device)
        units.append(ResidentUnit(f"param_groups.{g}", unit_names, tuple(params), flat, group))
    positions = registration_positions(trainable_groups, named)
    return ResidentModule(
        None, tuple(units), group, policy, comms_logger, placements, positions, device
    )


def _check_unique(param_groups: Sequence[MutableMapping[str, Any]]) -> None:
    seen: set[int] = set()
    for g, param_group in enumerate(param_groups):
        for param in param_group["params"]:
            if id(param) in seen:
                raise ConfigError(
                    f"a parameter appears twice in the optimizer's param groups (group {g}); "
                    "list every parameter once"
                )
            seen.add(id(param))


def sharded_section(config: ZeroConfig | None, sharded: ResidentModule | None) -> ZeroConfig:
    """The ``zero_optimization`` section: as given, else one at the sharded module's stage."""
    if config is not None:
        return config
    if sharded is None:
        return ZeroConfig()
    return ZeroConfig.model_validate({"stage": sharded.policy.stage})


def model_side_problems(
    config: ZeroConfig, sharded: ResidentModule | None, model_args: dict[str, object]
) -> list[tuple[str, str]]:
    """What contradicts between the model side and the arguments, as ``(key, message)``.

    ``model_args`` are the arguments of the params-only form (the model side's otherwise); a
    comms logger or placements the sharded module already has may be passed again.
    """
    if sharded is None:
        return []
    problems = []
    if config.stage != sharded.policy.stage:
        problems.append(
            (
                "zero_optimization.stage",
                f"is {config.stage} but the model was sharded at stage {sharded.policy.stage}; "
                "shard it with ZeroPolicy.from_config of the same section",
            )
        )
    own = {"comms_logger": sharded.comms_logger, "placements": sharded.placements}
    extra = [
        name
        for name, value in model_args.items()
        if value is not None and (name not in own or value is not own[name])
    ]
    if extra:
        problems.append(
            (
                f"ZeroOptimizer({', '.join(extra)}=)",
                "given with a sharded module, whose ZeroPolicy already holds the group and the "
                "gradient settings; drop the argument (or set it in the policy)",
            )
        )
    return problems
