"""`ZeroOptimizer` as a `deepshard.zero.access.PartitionedOwner` (stages 0-2).

Each trainable parameter's `ParamShard` says which flat range of it this rank's fp32 master
partition holds and where (``local_offset``). The tensors laid out like the master partition are
the master itself, the reduced gradient of the step (stage 0: the all-reduced buffer; stage 1:
the fp32 partition filled by the boundary pass; stage 2: the partition accumulator) and the inner
optimizer's state, which is kept per master *view* (`deepshard.zero._flat_params.master_views`):
a parameter's piece may straddle views, so its state is the matching slices of several state
tensors. The model's copy of every parameter is whole on every rank at stages 0-2.

With ``offload_optimizer`` the master and the CPU Adam kernel's moments are the offload's host
buffers or files (`deepshard.zero._offload_access`); the device then keeps only a
compute-dtype copy of the partition, which the accessors never read.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch

from deepshard.interface import ShardMap, ShardPiece
from deepshard.interface.errors import ConfigError
from deepshard.zero._owner_views import OwnerViews, flat_like
from deepshard.zero._shards import ParamShard

if TYPE_CHECKING:
    from deepshard.zero._full_grad_path import FullGroupsPath
    from deepshard.zero._full_grad_store import SplitGradients
    from deepshard.zero._offload import HostOffload
    from deepshard.zero._passes import BackwardPasses
    from deepshard.zero._resident import ResidentModule

__all__ = ["ZeroPartitionAccess"]


class ZeroPartitionAccess(OwnerViews):
    """The `PartitionedOwner` methods of `ZeroOptimizer` (a mixin: the optimizer sets the
    attributes below)."""

    inner: torch.optim.Optimizer
    _params: list[list[torch.nn.Parameter]]
    _masters: list[torch.Tensor]
    _full: FullGroupsPath
    _shards: tuple[ParamShard, ...]
    _store: SplitGradients
    _passes: BackwardPasses
    _offload: HostOffload | None
    _group: torch.distributed.ProcessGroup
    _resident: ResidentModule

    @property
    def partition_group(self) -> torch.distributed.ProcessGroup:
        """The data-parallel group the shard maps' ranks refer to."""
        return self._group

    @functools.cached_property
    def _shard_of(self) -> dict[int, tuple[int, ParamShard]]:
        """Each trainable parameter's group index and shard, by ``id``."""
        shards = iter(self._shards)
        return {
            id(param): (g, next(shards))
            for g, params in enumerate(self._params)
            for param in params
        }

    def _find(self, param: torch.Tensor) -> tuple[int, ParamShard] | None:
        found = self._shard_of.get(id(param))
        if found is None and param.requires_grad:
            raise ConfigError(
                f"this ZeroOptimizer does not train the parameter of shape {tuple(param.shape)}; "
                "pass the ZeroOptimizer whose inner optimizer holds it (expert parameters have "
                "their own), or set requires_grad=False on a parameter nothing trains"
            )
        return found

    def param_shard_map(self, param: torch.Tensor) -> ShardMap | None:
        """The shard map of ``param``'s fp32 master over `partition_group`; ``None`` when frozen.

        Raises:
            ConfigError: ``param`` is trainable but not one this optimizer holds.
        """
        found = self._find(param)
        return None if found is None else found[1].shard_map

    def param_group(self, param: torch.Tensor) -> torch.distributed.ProcessGroup:
        """The group ``param``'s shard map is over: its unit's (an expert's ``dp`` group when
        the model has several reduction groups), else `partition_group`."""
        found = self._find(param)
        return self._group if found is None else self._resident.units[found[0]].group

    def _locate(self, param: torch.Tensor) -> tuple[int, list[tuple[int, int]]] | None:
        found = self._find(param)
        if found is None:
            return None
        g, shard = found
        return g, [(p.local_offset, p.local_offset + p.numel) for p in self._pieces(shard, g)]

    def _grad_partition(self, index: int) -> torch.Tensor | None:
        return self._store.grad_partition(index) if self._passes.ready else None

    def _pieces(self, shard: ParamShard, unit: int) -> list[ShardPiece]:
        return list(shard.shard_map.pieces_of(self._resident.units[unit].group.rank()))

    def _state_slices(self, g: int, lo: int, hi: int, key: str | None) -> list[torch.Tensor]:
        """Slices of state ``key`` covering ``[lo, hi)`` of group ``g``'s master partition."""
        keys: set[str] = set()
        slices = []
        for view, start, _ in self._full.views[g]:  # the unit's views, whichever group steps them
            state = self.inner.state.get(view, {})
            keys.update(k for k, v in state.items() if flat_like(v, view))
            a, b = max(lo, start), min(hi, start + view.numel())
            if a < b and key in state and flat_like(state[key], view):
                slices.append(state[key].view(-1)[a - start : b - start])
        if key not in keys:
            raise ConfigError(
                f"the inner optimizer has no per-element state {key!r}; it holds "
                f"{sorted(keys) or 'none yet (state is created by its first step)'}"
            )
        return slices

    def write_model_param(self, param: torch.Tensor, value: torch.Tensor) -> None:
        """Copy the whole fp32 ``value`` into the model's parameter (its dtype)."""
        with torch.no_grad():
            param.copy_(value.view(param.shape))
