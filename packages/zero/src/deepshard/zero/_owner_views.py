"""The ``local_views`` / ``store_local_views`` half of `deepshard.zero.access.PartitionedOwner`,
shared by stages 0-2 (`deepshard.zero._owner`) and 3 (`deepshard.zero._stage3_owner`).

Both stages hold a trainable parameter's elements as ranges (*spans*) of one partition — a
param group's at stages 0-2 numbered by its unit, a unit's at stage 3 — and every tensor laid
out like that partition (the fp32 master, the reduced gradient, each per-element inner state, or
their offloaded copies) is read through the same spans. A stage says only where a parameter lives
(`_locate`), where its reduced gradient is (`_grad_partition`) and how its inner state is sliced
(`_state_slices`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from deepshard.zero._offload_access import offloaded_views, state_name, store_offloaded

if TYPE_CHECKING:
    from deepshard.zero._offload import HostOffload
    from deepshard.zero.access import StateKind

__all__ = ["OwnerViews", "flat_like"]

Spans = list[tuple[int, int]]
"""``[lo, hi)`` ranges of one partition, in the parameter's order."""


class OwnerViews:
    """`local_views` and `store_local_views` over a stage's `_locate` (a mixin: the optimizer
    sets the attributes below and the stage's owner mixin the three hooks)."""

    _masters: list[torch.Tensor]
    _offload: HostOffload | None
    check_resident: Callable[[str], None]
    """`deepshard.zero._states.StateOffload.check_resident` (the optimizer has both mixins)."""

    def _locate(self, param: torch.Tensor) -> tuple[int, Spans] | None:
        """The partition holding ``param`` and this rank's spans of it; ``None`` when frozen."""
        raise NotImplementedError

    def _grad_partition(self, index: int) -> torch.Tensor | None:
        """Partition ``index``'s reduced gradient, ``None`` when none exists now."""
        raise NotImplementedError

    def _state_slices(self, index: int, lo: int, hi: int, key: str | None) -> list[torch.Tensor]:
        """Slices of inner state ``key`` covering ``[lo, hi)`` of partition ``index``."""
        raise NotImplementedError

    def local_views(
        self, param: torch.Tensor, kind: StateKind, key: str | None = None
    ) -> list[torch.Tensor] | None:
        """This rank's elements of ``param``'s master, reduced gradient or inner state ``key``
        (see `deepshard.zero.access.PartitionedOwner.local_views`).

        Raises:
            CommError: States are offloaded (`deepshard.zero.ZeroOptimizer.reload_states` first).
            ConfigError: ``param`` is not one this optimizer holds, or ``key`` is no state.
        """
        self.check_resident(f"reading or writing a parameter's {kind}")
        found = self._locate(param)
        if found is None:
            return None
        index, spans = found
        if kind == "grad":
            grads = self._grad_partition(index)
            return None if grads is None else [grads[lo:hi] for lo, hi in spans]
        name = None if self._offload is None else state_name(self._offload, kind, key)
        if self._offload is not None and name is not None:
            return offloaded_views(self._offload, index, name, spans)
        if kind == "fp32":
            return [self._masters[index][lo:hi] for lo, hi in spans]
        return [view for lo, hi in spans for view in self._state_slices(index, lo, hi, key)]

    def store_local_views(
        self,
        param: torch.Tensor,
        kind: StateKind,
        key: str | None,
        views: Sequence[torch.Tensor],
    ) -> None:
        """Write views of NVMe-offloaded masters or moments back into their files."""
        if self._offload is None or kind == "grad":
            return
        found = self._locate(param)
        name = state_name(self._offload, kind, key)
        if found is not None and name is not None:
            store_offloaded(self._offload, found[0], name, found[1], views)


def flat_like(value: object, view: torch.Tensor) -> bool:
    """Whether ``value`` is a per-element state tensor of the master view ``view``."""
    return isinstance(value, torch.Tensor) and value.numel() == view.numel() and value.dim() > 0
