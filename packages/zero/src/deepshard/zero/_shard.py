"""`shard`: ZeRO's model-side verb — partition a model's parameters over data parallelism.

At stages 0-2 (``ZeroPolicy(stage=k)``) it builds a `ResidentModule` instead: the same units,
every one resident, laid out in buckets for the optimizer side's reductions
(`deepshard.zero._resident`). The rest of this note is stage 3.

``shard(model, parallel_dims=dims, policy=ZeroPolicy(...))`` cuts the model into units
(`deepshard.zero._units`), moves each unit's parameters into its flat layout, keeps this rank's
chunk, frees the rest and attaches the gather/release hooks (`deepshard.zero._sharded`). The
model keeps its class, its ``nn.Parameter`` objects and their names; nothing is patched onto
them. The returned `ShardedModule` is what the optimizer side (`deepshard.zero.ZeroOptimizer`
given it as second argument) and `shard_info` work through.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

import torch

from deepshard.comm import CommsLogger, Group, ParallelDims, mark_collective_forward, resolve_group
from deepshard.interface import PlacementRegistry
from deepshard.interface.errors import ConfigError
from deepshard.zero._lookup import owner_of
from deepshard.zero._param_offload import build_homes
from deepshard.zero._policy import ZeroPolicy
from deepshard.zero._resident import ResidentModule, build_resident
from deepshard.zero._rgroups import axes_of, reduction_groups
from deepshard.zero._shard_info import ShardInfo, build_shard_infos
from deepshard.zero._sharded import ShardedModule, UnitHook
from deepshard.zero._tp import tp_group_for
from deepshard.zero._unit_state import UnitState
from deepshard.zero._units import plan_units

__all__ = ["register_external_parameter", "shard", "shard_info", "sharded_module_of"]


def sharded_module_of(module: torch.nn.Module) -> ShardedModule | None:
    """The `ShardedModule` whose unit ``module`` is, found through its own forward hooks."""
    for hook in module._forward_pre_hooks.values():
        if isinstance(hook, UnitHook):
            return hook.sharded
    return None


def shard(
    module: torch.nn.Module,
    *,
    parallel_dims: ParallelDims | None = None,
    group: Group | None = None,
    policy: ZeroPolicy | None = None,
    placements: PlacementRegistry | None = None,
    comms_logger: CommsLogger | None = None,
) -> ShardedModule | ResidentModule:
    """Partition ``module``'s parameters over the dense data-parallel group (ZeRO stage 3), or
    lay them out per unit for the reductions of stages 0-2 (``policy.stage`` below 3: a
    `ResidentModule`, every unit resident, `deepshard.zero._resident`).

    Move and cast the model first: partitions keep the parameters' device and dtype.

    Args:
        module: The model; it stays the user's object.
        parallel_dims: The training mesh; its ``dense_dp`` group partitions the parameters.
        group: Instead of ``parallel_dims``, the data-parallel group (a ProcessGroup or 1-D
            mesh).
        policy: Units, prefetch/reuse/persistence knobs, mixed precision; the defaults of
            `ZeroPolicy` when ``None``.
        placements: Every parameter's placement (its global shape and reduction axes), from
            which the shard maps are derived; ``None``: every parameter whole on every rank.
        comms_logger: Records every all-gather and reduce-scatter.

    Returns:
        The handle that gathers, releases and reduces (stage 3); at stages 0-2 the resident
        units the optimizer side (`deepshard.zero.ZeroOptimizer`) reduces and refreshes.

    Raises:
        ConfigError: ``module`` is already sharded, neither or both of ``parallel_dims`` and
            ``group`` are given, or a unit mixes dtypes or devices.
        TopologyError: A placement does not fit its parameter or the group.
    """
    if (parallel_dims is None) == (group is None):
        raise ConfigError(
            "shard() needs exactly one of parallel_dims= (a deepshard.comm.ParallelDims) or "
            "group= (the data-parallel group)"
        )
    if any(sharded_module_of(m) is not None for m in module.modules()):
        raise ConfigError(
            f"{type(module).__name__} is already sharded (ZeRO stage 3); shard a model once, "
            "or call remove_hooks() on its ShardedModule first"
        )
    policy = policy if policy is not None else ZeroPolicy()
    pg = resolve_group(parallel_dims.dense_dp if parallel_dims is not None else group)
    if policy.param_dtype is not None:
        module.to(policy.param_dtype)
    groups = reduction_groups(module, pg, parallel_dims, placements)
    tp_group = tp_group_for(placements, parallel_dims)
    if groups and tp_group is not None and policy.stage == 0:
        raise ConfigError(
            "ZeroPolicy(stage=0): tensor-parallel placements together with several reduction "
            f"groups ({sorted(groups)} besides the dense one) are not built at stage 0; use "
            "ZeroPolicy(stage=1), 2 or 3"
        )
    if policy.stage < 3:
        return build_resident(
            module, pg, policy, placements, comms_logger, tp_group=tp_group, groups=groups
        )
    return build_sharded(
        module, pg, policy, placements, comms_logger, groups=groups, tp_group=tp_group
    )


class ParamSource(Protocol):
    """Where `build_sharded` gets parameters that are not whole (`deepshard.zero.Init`'s)."""

    def full_shapes(self) -> Mapping[int, tuple[int, ...]]:
        """The full shape of every parameter it holds, by ``id``."""
        ...

    def materialize(self, params: Sequence[torch.nn.Parameter]) -> None:
        """Make those of ``params`` it holds whole again (a collective) and forget them."""
        ...


def build_sharded(
    module: torch.nn.Module,
    pg: torch.distributed.ProcessGroup,
    policy: ZeroPolicy,
    placements: PlacementRegistry | None,
    comms_logger: CommsLogger | None,
    *,
    source: ParamSource | None = None,
    groups: Mapping[tuple[str, ...], torch.distributed.ProcessGroup] | None = None,
    tp_group: torch.distributed.ProcessGroup | None = None,
) -> ShardedModule:
    """`shard` after its checks: plan the units, then build and release them one at a time.

    With ``source``, parameters already partitioned elsewhere (`deepshard.zero.Init`'s slices,
    `deepshard.zero.Repartition`'s) are made whole one unit at a time, just before their unit
    keeps its chunk (so at most one unit is whole at once).
    ``groups`` (reduction axes → process group, `reduction_groups`) gives each parameter whose
    placement names one of them a unit plan of its own over that group; ``tp_group`` is the
    tensor-parallel group the step combines the norm over (`deepshard.zero._tp`).
    """
    shapes = source.full_shapes() if source is not None else None
    groups = dict(groups or {})
    if groups and policy.param_offload is not None:
        raise ConfigError(
            "several reduction groups (expert and dense parameters in one model) are not "
            "built with ZeroPolicy(param_offload=...) yet; shard the model without it"
        )
    plans = plan_units(
        module,
        policy,
        world_size=pg.size(),
        shapes=shapes,
        reduce_over=axes_of(module, placements, groups),
        world_of=lambda axes: groups[axes].size(),
    )
    unit_groups = [groups[plan.reduce_over] if plan.reduce_over else pg for plan in plans]
    infos = build_shard_infos(plans, unit_groups, placements)
    device = next((p.device for plan in plans for p in plan.params), torch.device("cpu"))
    numels = [plan.layout.partition_numel for plan in plans]
    home = build_homes(policy.param_offload, numels, device)
    states = []
    for plan in plans:
        if source is not None:
            source.materialize(plan.params)
        state = UnitState(plan, unit_groups[plan.index], comms_logger, home)
        state.release()
        states.append(state)
    if pg.size() > 1:  # every forward now gathers over pg: generate in lockstep
        mark_collective_forward(module)
    return ShardedModule(module, plans, states, infos, pg, policy, comms_logger, tp_group=tp_group)


def register_external_parameter(module: torch.nn.Module, param: torch.Tensor) -> None:
    """Make ``module`` (a unit of a sharded model) gather ``param`` whenever it runs.

    For a parameter used outside the module that owns it (DeepSpeed's function of the same
    name); the `ShardedModule` is found through the hooks on ``module``.

    Raises:
        ConfigError: ``module`` is not a unit of a sharded model, or ``param`` not one of its
            parameters.
    """
    sharded = sharded_module_of(module)
    if sharded is None:
        raise ConfigError(
            f"register_external_parameter: {type(module).__name__} is not a unit of a model "
            "sharded by deepshard.zero.shard; pass a unit's module (or use "
            "ShardedModule.register_external_parameter)"
        )
    sharded.register_external_parameter(module, param)


def shard_info(first: ShardedModule | torch.Tensor, param: torch.Tensor | None = None) -> ShardInfo:
    """The full shape, numel, dtype, slice and `ShardMap` of a stage-3 parameter.

    ``shard_info(param)`` finds the parameter's `ShardedModule` through ZeRO's hook on it;
    ``shard_info(sharded, param)`` is ``sharded.shard_info(param)``.

    Raises:
        ConfigError: The tensor is not a parameter of a sharded model.
    """
    if isinstance(first, ShardedModule):
        if param is None:
            raise ConfigError("shard_info(sharded, param): param is missing")
        return first.shard_info(param)
    return owner_of(first, argument="shard_info(param)").shard_info(first)
