"""``offload_states`` / ``reload_states`` at ZeRO stage 3: which tensors each state type is.

The mechanism is stages 0-2's (`deepshard.zero._states.StateOffload`: each selected storage is
copied into a host buffer and resized to zero bytes, then regrown and refilled on reload, so
every view stays valid and training continues bit for bit). Stage 3 only says what the state
types are:

* ``optim_states``: the inner optimizer's state tensors (with ``offload_optimizer`` the moments
  already live on the host or in files and stay there);
* ``hp_params``: the fp32 master partitions held beside the partitions (an fp32 partition is its
  own master; with ``offload_optimizer`` they are on the host already, but for a partial
  offload's device share, whose masters and moments count here and under ``optim_states``);
* ``lp_params``: every unit's parameter partition (a host buffer with ``offload_param: cpu``;
  with ``nvme`` it is in a file and holds no bytes);
* ``lp_grads``: the reduced gradient partitions (from the boundary's backward to the step);
* ``contiguous_grad_buffer``: none at stage 3 (gradients are flattened per unit, per pass).

Gathered buffers are copies of the partitions: offloading releases every unit first (the next
forward gathers again), so no parameter views memory that is released, and gathering an
offloaded partition raises `CommError` naming ``reload_states()``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from deepshard.zero._states import StateOffload, _Released

if TYPE_CHECKING:
    from deepshard.zero._offload import HostOffload
    from deepshard.zero._sharded import ShardedModule

__all__ = ["Stage3States"]


class Stage3States(StateOffload):
    """The stage-3 state types for `StateOffload` (a mixin of `Stage3Optimizer`)."""

    sharded: ShardedModule
    _offload: HostOffload | None

    def _in_backward(self) -> bool:
        return self.sharded.in_pass

    def _state_tensors(self, name: str) -> list[torch.Tensor]:
        share = None if self._offload is None else self._offload.device_share
        if name == "optim_states":
            inner = [v for s in self.inner.state.values() for v in s.values()]
            moments = [m for ms in share.moments for m in ms] if share is not None else []
            return [t for t in inner if isinstance(t, torch.Tensor)] + moments
        if name == "hp_params":
            return list(self._masters) + (list(share.masters) if share is not None else [])
        if name == "lp_params":
            return [u.partition for u in self.sharded.units]
        if name == "lp_grads":
            return [u.grad_partition for u in self.sharded.units if u.grad_partition is not None]
        return []  # contiguous_grad_buffer: stage 3 keeps none between passes

    def _point_params_at_empty(self, released: dict[int, _Released]) -> None:
        """Release every gathered unit: parameters then view empty tensors only."""
        self.sharded.fetcher.release_all()

    def _point_params_at_buffers(self) -> None:
        """Nothing to re-point: the next forward gathers from the reloaded partitions."""
