"""Partial optimizer offload at ZeRO stage 3 (``offload_optimizer.ratio`` below 1).

DeepSpeed's hybrid: of the stage-3 sub-groups (`deepshard.zero._stage3_offload.stage3_sub_groups`,
in unit order), the first ``int((1 - ratio) · n)`` are stepped on the device and the other
``ratio`` share on the host, through the offload pipeline (`deepshard.zero._offload.HostOffload`)
unchanged. DeepSpeed steps its device share with a backup ``torch.optim.AdamW``; here a
`DeviceShare` keeps each device sub-group's master (fp32, or the 16-bit masters' dtype) and both
Adam moments on the device and
applies the CPU Adam kernel's formula with torch operations, with the hyper-parameters the
kernel reads (`deepshard.zero._offload_plan.AdamRule`, every step, so LR schedules hold) and the
offload's step count. The stepped master goes back through the unit's home, like a host
sub-group's. So only Adam-family optimizers are accepted (as DeepSpeed accepts only
``DeepSpeedCPUAdam``) and only with ``device: "cpu"``.

The host buffers (`deepshard.zero._offload_state.HostState`) keep every unit's master and
moments whole, as with full offload; over device sub-groups they are a mirror, written by
`DeviceShare.to_host` only when something reads the whole state (``master_partitions``,
``state_dict``, the ``safe_get_*`` accessors, a partition written by hand) and read back by
`DeviceShare.from_host` after it was written.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from deepshard.zero._offload_plan import AdamHyper, AdamRule, SubGroup
from deepshard.zero._offload_state import HostState

__all__ = ["DeviceShare", "split_sub_groups"]


def split_sub_groups(
    subs: Sequence[SubGroup], ratio: float
) -> tuple[tuple[SubGroup, ...], tuple[SubGroup, ...]]:
    """``(device share, host share)``: the first ``int((1 - ratio) · n)`` sub-groups stay on
    the device, as DeepSpeed assigns them."""
    on_device = int((1.0 - ratio) * len(subs))
    return tuple(subs[:on_device]), tuple(subs[on_device:])


def adam_update(
    master: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    hyper: AdamHyper,
    step: int,
) -> None:
    """One Adam step of ``master`` in place: the CPU Adam kernel's formula in torch operations
    (fp32 math; a 16-bit master and 16-bit moments are widened, then stored back rounded once,
    as the kernel does)."""
    grad = grad.float()
    param = master.float()  # the master itself when fp32
    if hyper.weight_decay and not hyper.adamw_mode:
        grad = grad.add(param, alpha=hyper.weight_decay)  # Adam's L2 term
    m, v = exp_avg.float(), exp_avg_sq.float()  # the moments themselves when fp32
    m.mul_(hyper.beta1).add_(grad, alpha=1.0 - hyper.beta1)
    v.mul_(hyper.beta2).addcmul_(grad, grad, value=1.0 - hyper.beta2)
    first, second = 1.0, 1.0
    if hyper.bias_correction:
        first, second = 1.0 - hyper.beta1**step, 1.0 - hyper.beta2**step
    if hyper.weight_decay and hyper.adamw_mode:
        param.mul_(1.0 - hyper.lr * hyper.weight_decay)
    denom = (v.sqrt() / math.sqrt(second)).add_(hyper.eps)
    param.addcdiv_(m, denom, value=-hyper.lr / first)
    if param.data_ptr() != master.data_ptr():
        master.copy_(param)
    if m.data_ptr() != exp_avg.data_ptr():
        exp_avg.copy_(m)
        exp_avg_sq.copy_(v)


class DeviceShare:
    """The device sub-groups of a partial offload: masters and moments on the device.

    Args:
        subs: The device sub-groups.
        values: Per unit, this rank's partition values (the masters start from them).
        moment_dtype: The moments' dtype (``fp32_optimizer_states``).
        device: The compute device.
        master_dtype: The masters' dtype (fp32, or 16-bit masters).
    """

    def __init__(
        self,
        subs: Sequence[SubGroup],
        values: Sequence[torch.Tensor],
        moment_dtype: torch.dtype,
        device: torch.device,
        master_dtype: torch.dtype = torch.float32,
    ) -> None:
        self.sub_groups = tuple(subs)
        self.masters = [
            values[s.group][s.start : s.stop].to(device, master_dtype, copy=True) for s in subs
        ]
        self.moments = [
            [torch.zeros(s.numel, dtype=moment_dtype, device=device) for s in subs]
            for _ in range(2)
        ]

    def step(
        self,
        inner: torch.optim.Optimizer,
        grads: Sequence[torch.Tensor],
        rule: AdamRule,
        steps: Sequence[int],
        write_back: Callable[[SubGroup, torch.Tensor], None],
    ) -> None:
        """Step every device sub-group with its (already unscaled, clipped) gradient and write
        the result back through ``write_back``."""
        for k, sub in enumerate(self.sub_groups):
            hyper = rule(inner.param_groups[sub.param_group])
            grad = grads[sub.group][sub.start : sub.stop]
            master = self.masters[k]
            adam_update(master, grad, self.moments[0][k], self.moments[1][k], hyper,
                        steps[sub.group])  # fmt: skip
            write_back(sub, master)

    def write_all(self, write_back: Callable[[SubGroup, torch.Tensor], None]) -> None:
        """Write every device master back (after a load)."""
        for sub, master in zip(self.sub_groups, self.masters, strict=True):
            write_back(sub, master)

    def _pairs(self, state: HostState) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``(device tensor, host mirror)`` for every master and moment of the share."""
        assert len(state.moments) == 2, "a partial offload steps with the CPU Adam formula"
        host = [state.masters, *state.moments]
        mine = [self.masters, *self.moments]
        return [
            (dev[k], whole[sub.group][sub.start : sub.stop])
            for dev, whole in zip(mine, host, strict=True)
            for k, sub in enumerate(self.sub_groups)
        ]

    def to_host(self, state: HostState) -> None:
        """Write the share's masters and moments into the host buffers' mirror ranges."""
        for device, host in self._pairs(state):
            host.copy_(device)

    def from_host(self, state: HostState) -> None:
        """Read the share's masters and moments back from the host buffers."""
        for device, host in self._pairs(state):
            device.copy_(host)

    def nbytes(self) -> tuple[int, int]:
        """Device bytes of ``(masters, moments)``."""
        masters = sum(m.numel() * m.element_size() for m in self.masters)
        moments = sum(m.numel() * m.element_size() for ms in self.moments for m in ms)
        return masters, moments
