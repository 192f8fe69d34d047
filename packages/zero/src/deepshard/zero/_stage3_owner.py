"""`Stage3Optimizer` as a `deepshard.zero.access.PartitionedOwner` (ZeRO stage 3).

At stage 3 every tensor laid out like a unit's partition is one per *unit*: the fp32 master
(the trainable prefix of the partition, `deepshard.zero._units.UnitPlan.trainable_numel`), the
gradient partition the backward passes reduce-scattered into (it exists from the boundary
pass to ``step()``), and the inner optimizer's state, kept per master *view* (ranges of one
param group's parameters in one unit). A parameter's `ShardMap` (from its `ShardInfo`) says
which flat range of it the rank holds and where in the unit's partition (``local_offset``), so
the ``safe_get_*`` / ``safe_set_*`` functions work unchanged.

Unlike stages 0-2 the model's own copy is partitioned too: setting a parameter writes the
rank's piece into the unit's partition through its home (rounded to the model dtype; a host
buffer or a file with ``offload_param``) and, when the unit is gathered right now, the whole
value into the gathered buffer, so the next forward sees it whether or not it re-gathers.

With ``offload_optimizer`` the masters and the CPU Adam kernel's moments (``exp_avg``,
``exp_avg_sq``, whole per unit) are the offload's: host buffers read and written in place
(``cpu``) or ranges of the swap files read into host copies and written back by
`store_local_views` (``nvme``), as `deepshard.zero._offload_access` says. An optimizer stepped
as itself on host master views keeps its own state, read as without offload.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from deepshard.interface import ShardMap
from deepshard.interface.errors import ConfigError
from deepshard.zero._owner_views import OwnerViews, flat_like

if TYPE_CHECKING:
    from deepshard.zero._offload import HostOffload
    from deepshard.zero._shard_info import ShardInfo
    from deepshard.zero._sharded import ShardedModule

__all__ = ["Stage3PartitionAccess"]

View = tuple[int, torch.Tensor, int, int]
"""``(unit, master view, lo, hi)``, as `deepshard.zero._stage3_optimizer` keeps them."""


class Stage3PartitionAccess(OwnerViews):
    """The `PartitionedOwner` methods of `Stage3Optimizer` (a mixin ahead of the stage 0-2 one;
    the optimizer sets the attributes below)."""

    inner: torch.optim.Optimizer
    sharded: ShardedModule
    _masters: list[torch.Tensor]
    _views: list[View]
    _offload: HostOffload | None
    _group: torch.distributed.ProcessGroup
    _ready: bool

    def _info(self, param: torch.Tensor) -> ShardInfo | None:
        """``param``'s `ShardInfo`; ``None`` when it is frozen (nothing trains it)."""
        if not param.requires_grad:
            return None
        try:
            return self.sharded.shard_info(param)
        except ConfigError:
            raise ConfigError(
                f"this ZeroOptimizer does not train the parameter of shape {tuple(param.shape)}: "
                "it is not a parameter of the sharded module; pass the ZeroOptimizer built on "
                "the ShardedModule that holds it, or set requires_grad=False on it"
            ) from None

    def param_shard_map(self, param: torch.Tensor) -> ShardMap | None:
        """The shard map of ``param``'s fp32 master over its unit's group (`param_group`);
        ``None`` when frozen.

        Raises:
            ConfigError: ``param`` is trainable but not a parameter of the sharded module.
        """
        info = self._info(param)
        return None if info is None else info.shard.shard_map

    def param_group(self, param: torch.Tensor) -> torch.distributed.ProcessGroup:
        """The group ``param``'s shard map is over: its unit's (an expert unit's ``dp`` group
        when the model has several reduction groups), else `partition_group`."""
        info = self._info(param)
        return self._group if info is None else self.sharded.units[info.unit].group

    def _locate(self, param: torch.Tensor) -> tuple[int, list[tuple[int, int]]] | None:
        info = self._info(param)
        return None if info is None else (info.unit, self._spans(info))

    def _grad_partition(self, index: int) -> torch.Tensor | None:
        return self.sharded.units[index].grad_partition if self._ready else None

    def _spans(self, info: ShardInfo) -> list[tuple[int, int]]:
        """This rank's ranges of the parameter in its unit's partition."""
        pieces = info.shard.shard_map.pieces_of(self.sharded.units[info.unit].rank)
        return [(p.local_offset, p.local_offset + p.numel) for p in pieces]

    def _state_entries(self, unit: int) -> list[tuple[dict[str, torch.Tensor], View]]:
        """Every master view of ``unit`` with its per-element state (with offload, the host
        master views of an optimizer stepped as itself)."""
        if self._offload is None:
            return [(self.inner.state.get(v[1], {}), v) for v in self._views if v[0] == unit]
        views = self._offload.views[unit]
        return [(self.inner.state.get(v, {}), (unit, v, lo, hi)) for v, lo, hi in views]

    def _state_slices(self, unit: int, lo: int, hi: int, key: str | None) -> list[torch.Tensor]:
        """Slices of state ``key`` covering ``[lo, hi)`` of ``unit``'s master."""
        keys: set[str] = set()
        slices = []
        for state, (_, view, start, stop) in self._state_entries(unit):
            flat = {k for k, v in state.items() if flat_like(v, view)}
            keys |= flat
            a, b = max(lo, start), min(hi, stop)
            if a < b and key in flat:
                slices.append(state[key].view(-1)[a - start : b - start])
        if key not in keys:
            raise ConfigError(
                f"the inner optimizer has no per-element state {key!r}; it holds "
                f"{sorted(keys) or 'none yet (state is created by its first step)'}"
            )
        return slices

    def write_model_param(self, param: torch.Tensor, value: torch.Tensor) -> None:
        """Write the whole fp32 ``value`` into the rank's piece of the unit's partition (and
        into the gathered buffer, when the unit is gathered now)."""
        info = self.sharded.shard_info(param)
        state = self.sharded.units[info.unit]
        flat = value.reshape(-1)
        with torch.no_grad():
            piece = flat[info.flat_start : info.flat_stop].clone()  # a file write pins it
            state.home.write(piece, info.local_offset)
            state.home.flush()
            if state.in_flight:  # the gather read the old partition: finish it, then overwrite
                state.wait_gather()
            if state.gathered:
                param.data.copy_(flat.view(param.shape))
