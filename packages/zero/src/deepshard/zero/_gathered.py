"""`GatheredParameters` and `partition`: stage-3 parameters whole by hand, and written back.

``with GatheredParameters(params, modifier_rank=r):`` gathers the units owning ``params`` on
entry (a collective: every rank of the data-parallel group must enter) and keeps them gathered
until the block exits, also across forwards inside it (they count as in use, so nested blocks
and forward hooks never release what an outer block holds). On exit with ``modifier_rank=r``
the listed parameters' values on group rank ``r`` are broadcast (one call per unit, the listed
parameters packed), every rank writes its own range of them into its partition, and the
`ShardedModule` tells its observers (the optimizer side refreshes its fp32 masters there, so
training continues from the modified weights). With ``modifier_rank=None`` nothing is written;
a unit nobody holds any more is released, so its next use re-gathers the partitions and the
changes are gone. Inside an outer block, the outer block's exit decides for what it holds.

`partition` is DeepSpeed's ``param.partition(free_data=...)``: it writes each rank's own range
of the (possibly changed) whole parameters into the partitions without communicating, then
frees the gathered storage, or with ``free_data=False`` leaves each parameter its whole values
in storage of its own for the caller.
"""

from __future__ import annotations

from collections.abc import Iterable
from types import TracebackType
from typing import Any

import torch

from deepshard.comm import broadcast
from deepshard.interface.errors import ConfigError
from deepshard.zero._init_slices import InitSlices
from deepshard.zero._lookup import owner_of, owner_or_slices
from deepshard.zero._sharded import ShardedModule

__all__ = ["GatheredParameters", "partition"]

Owner = ShardedModule | InitSlices


def _as_list(params: Any, argument: str) -> list[torch.Tensor]:
    """A single tensor or any iterable of tensors, as a list without repeats."""
    if isinstance(params, torch.Tensor):
        return [params]
    try:
        items = list(params)
    except TypeError:
        raise ConfigError(
            f"{argument}: expected a parameter or an iterable of parameters, got "
            f"{type(params).__name__}"
        ) from None
    return list({id(p): p for p in items}.values())


def _by_owner(params: list[torch.Tensor], argument: str) -> list[tuple[Owner, list[Any]]]:
    """``params`` grouped by the object owning them, in order of first appearance."""
    groups: dict[int, tuple[Owner, list[Any]]] = {}
    for param in params:
        owner = owner_or_slices(param, argument=argument)
        groups.setdefault(id(owner), (owner, []))[1].append(param)
    return list(groups.values())


def _units(sharded: ShardedModule, params: list[torch.Tensor]) -> list[int]:
    return sorted({sharded.shard_info(p).unit for p in params})


def _slot_index(sharded: ShardedModule, unit: int, param: torch.Tensor) -> int:
    return next(i for i, p in enumerate(sharded.plans[unit].params) if p is param)


def _sync_into_buffer(sharded: ShardedModule, unit: int, param: torch.Tensor) -> torch.Tensor:
    """``param``'s slot of the gathered buffer, holding ``param``'s values, ``.data`` on it.

    A parameter whose ``.data`` was replaced (not changed in place) is copied in first.
    """
    state = sharded.units[unit]
    slot = state.plan.layout.slots[_slot_index(sharded, unit, param)]
    view = state.buffer[slot.offset : slot.stop]
    data = param.data
    if data.numel() != slot.numel:
        raise ConfigError(
            f"parameter {sharded.shard_info(param).name!r} has {data.numel()} elements but its "
            f"full shape is {slot.shape}; change stage-3 parameters in place (or assign a "
            "tensor of the full shape) inside GatheredParameters"
        )
    if data.data_ptr() != view.data_ptr():
        view.copy_(data.reshape(-1))
    param.data = view.view(slot.shape)
    return view


def _write_local(sharded: ShardedModule, param: torch.Tensor, flat: torch.Tensor) -> None:
    """Write this rank's range of the whole flat ``param`` values into its partition."""
    info = sharded.shard_info(param)
    home = sharded.units[info.unit].home  # the device, a host buffer or a file
    with torch.no_grad():
        # a copy: a file write would pin the gathered buffer's storage, which release resizes
        home.write(flat[info.flat_start : info.flat_stop].clone(), info.local_offset)
        home.flush()


def _broadcast_and_write(sharded: ShardedModule, params: list[Any], src: int) -> None:
    """Broadcast ``params`` from group rank ``src``, one packed call per unit; keep them."""
    units = _units(sharded, params)
    for unit in units:
        members = [p for p in params if sharded.shard_info(p).unit == unit]
        views = [_sync_into_buffer(sharded, unit, p) for p in members]
        packed = torch.cat(views) if len(views) > 1 else views[0]
        broadcast(
            packed,
            group_src=src,
            group=sharded.group,
            logger=sharded.comms_logger,
            log_name="zero3_modifier_broadcast",
        )
        if len(views) > 1:
            offset = 0
            for view in views:
                view.copy_(packed[offset : offset + view.numel()])
                offset += view.numel()
        for param, view in zip(members, views, strict=True):
            _write_local(sharded, param, view)
    sharded.partitions_written(units)


class GatheredParameters:
    """Gather stage-3 parameters for the block; with ``modifier_rank`` keep one rank's changes.

    Every rank of the data-parallel group must enter the block (gathering is a collective)
    with the same parameters in the same order.

    Args:
        params: A parameter or any iterable of them (of sharded models, or of an open
            `deepshard.zero.Init` block).
        modifier_rank: Group rank whose in-place changes are broadcast and kept on exit;
            ``None`` discards every change.
        fwd_module: Make these parameters external parameters of this module (DeepSpeed's
            meaning): its unit gathers them whenever it runs, also after the block.
        enabled: ``False`` makes the block do nothing.

    Raises:
        ConfigError: A tensor ZeRO stage 3 does not own, a ``modifier_rank`` outside the group,
            or ``fwd_module`` with parameters of an open ``Init`` block.
    """

    def __init__(
        self,
        params: torch.Tensor | Iterable[torch.Tensor],
        modifier_rank: int | None = None,
        fwd_module: torch.nn.Module | None = None,
        enabled: bool = True,
    ) -> None:
        self.enabled, self.modifier_rank = enabled, modifier_rank
        self._groups: list[tuple[Owner, list[Any]]] = []
        if not enabled:
            return
        argument = "GatheredParameters(params)"
        self._groups = _by_owner(_as_list(params, argument), argument)
        for owner, _ in self._groups:
            if modifier_rank is not None and isinstance(owner, ShardedModule):
                _check_one_group(owner, modifier_rank)
            size = owner.group.size()
            if modifier_rank is not None and not 0 <= modifier_rank < size:
                raise ConfigError(
                    f"GatheredParameters(modifier_rank={modifier_rank}): must be a rank of the "
                    f"data-parallel group (0..{size - 1}) or None"
                )
        if fwd_module is not None:
            self._register_external(fwd_module)

    def _register_external(self, fwd_module: torch.nn.Module) -> None:
        for owner, params in self._groups:
            if isinstance(owner, InitSlices):
                raise ConfigError(
                    "GatheredParameters(fwd_module=): parameters of an open deepshard.zero.Init "
                    "block have no units yet; register them after the block exits"
                )
            unit = _unit_running(owner, fwd_module)
            for param in params:
                owner.register_external_parameter(owner.plans[unit].module, param)

    def __enter__(self) -> GatheredParameters:
        for owner, params in self._groups:
            if isinstance(owner, InitSlices):
                owner.gather(params)
            else:
                owner.hold(_units(owner, params))
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        # After an exception on some rank no collective is safe: changes are discarded.
        src = self.modifier_rank if exc_type is None else None
        for owner, params in self._groups:
            if isinstance(owner, InitSlices):
                owner.scatter(params, src)
                continue
            if src is not None:
                _broadcast_and_write(owner, params, src)
            owner.unhold(_units(owner, params))


def _unit_running(sharded: ShardedModule, module: torch.nn.Module) -> int:
    """The deepest unit whose module contains ``module`` (whose forward runs it).

    Raises:
        ConfigError: ``module`` is not part of the sharded model.
    """
    for plan in reversed(sharded.plans):
        if any(sub is module for sub in plan.module.modules()):
            return plan.index
    raise ConfigError(
        f"GatheredParameters(fwd_module=): {type(module).__name__} is not part of the sharded "
        "model owning these parameters"
    )


def partition(params: torch.Tensor | Iterable[torch.Tensor], *, free_data: bool = True) -> None:
    """Write whole stage-3 parameters back into their partitions (``param.partition()``).

    Each rank writes its own range from its own values (no communication; the ranks' values
    must agree), the optimizer's masters follow, and a unit nothing holds is released.

    Args:
        params: Gathered parameters (inside `GatheredParameters`, or left whole by an earlier
            ``partition(..., free_data=False)``).
        free_data: Free the gathered storage; ``False`` leaves each parameter its whole values
            in storage of its own (the unit's buffer is freed all the same).

    Raises:
        ConfigError: A tensor ZeRO stage 3 does not own, or one that is not whole.
    """
    argument = "partition(params)"
    for _, members in _by_owner(_as_list(params, argument), argument):
        sharded = owner_of(members[0], argument=argument)
        kept: list[tuple[torch.Tensor, torch.Tensor]] = []
        for param in members:
            info = sharded.shard_info(param)
            if param.data.numel() != info.numel:
                raise ConfigError(
                    f"partition(params): {info.name!r} is not gathered (its data has "
                    f"{param.data.numel()} of {info.numel} elements); gather it first with "
                    "deepshard.zero.GatheredParameters"
                )
            _write_local(sharded, param, param.data.reshape(-1))
            if not free_data:
                kept.append((param, param.data.clone()))
        units = _units(sharded, members)
        sharded.partitions_written(units)
        for param in members:
            if sharded.units[sharded.shard_info(param).unit].gathered:
                _sync_into_buffer(sharded, sharded.shard_info(param).unit, param)
        sharded.release_unused(units)
        for param, data in kept:
            param.data = data


def _check_one_group(sharded: ShardedModule, modifier_rank: int) -> None:
    """``modifier_rank`` is a rank of one group; several (expert and dense) are not built."""
    if sharded.mixed_groups:
        raise ConfigError(
            f"GatheredParameters(modifier_rank={modifier_rank}) is not built for a model with "
            "several reduction groups (expert and dense parameters) yet; use "
            "modifier_rank=None, or change the weights before deepshard.zero.shard"
        )
