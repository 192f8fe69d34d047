"""`HostOffload`: ZeRO stages 1-2 with the optimizer step on the host (``offload_optimizer``).

This rank's fp32 master partition and the optimizer state live on the host (``device: "cpu"``)
or in files (``"nvme"``, `deepshard.zero._offload_state`); the device keeps only the model's flat
buffer, the gradients, and a copy of its master partition in the compute dtype, which the
all-gather after the step reads (`device_partitions`). One step, sub-group by sub-group
(`deepshard.zero._offload_plan.plan_sub_groups`):

1. the unscaled, clipped gradients of sub-group k+1 are copied into one of two host staging
   buffers (page-locked where the accelerator can, asynchronously on a device) while sub-group
   k steps from the other, so the host holds two sub-groups' gradients, never a partition's;
2. sub-group k's master and moments are acquired (with NVMe: read ahead while k-1 stepped) and
   stepped by DeepShard's CPU Adam kernel, whose ``param_out`` writes the updated parameters in
   the compute dtype into a host buffer on the way (for an fp32 model the master is copied);
   an optimizer other than Adam is stepped itself on host master views;
3. the state is released (NVMe: written behind) and the updated parameters are copied to the
   device partition, from which ZeRO all-gathers the parameters as without offload.

On a CPU-only machine the host is the device: the same buffers are separate and every copy
happens, synchronously.

At stage 3 with ``ratio`` below 1 a `deepshard.zero._partial_offload.DeviceShare` steps the
first sub-groups on the device before the host pipeline runs the rest (``sub_groups`` are then
the host share only).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import torch

from deepshard.accelerators import CpuAccelerator, get_accelerator
from deepshard.interface.config import AioConfig, ZeroConfig
from deepshard.interface.errors import CheckpointError
from deepshard.kernels import cpu_adam_step
from deepshard.zero._flat_params import FlatParams, master_views
from deepshard.zero._master_dtype import host_moment_dtype
from deepshard.zero._offload_plan import (
    AdamRule,
    SubGroup,
    adam_rule,
    offload_device,
    offload_problems,
    plan_sub_groups,
)
from deepshard.zero._offload_state import Allocate, HostState, NvmeState, host_allocator
from deepshard.zero._optimizer_check import master_view_numel
from deepshard.zero._partial_offload import DeviceShare

__all__ = ["HostOffload", "build_offload", "grad_staging", "offload_problems"]

Views = list[tuple[torch.Tensor, int, int]]


def _noop() -> None:
    return None


class HostOffload:
    """The host side of one `ZeroOptimizer`: state, host buffers, and the step pipeline.

    Build it with `build_offload`.

    Args:
        subs: The sub-groups.
        state: Where masters and moments live.
        rule: Reads Adam hyper-parameters from a param group; ``None`` steps the inner optimizer.
        views: Per group, the host master views the inner optimizer's group holds, with their
            ``[lo, hi)`` range of the partition.
        grad_staging: Two host buffers of the largest sub-group's size: sub-group ``k``'s
            gradient is copied into buffer ``k % 2`` while sub-group ``k - 1`` steps from the
            other (`grad_staging`), so the host never holds a whole gradient partition.
        host_out: Per group, the host buffer of the updated partition in the compute dtype.
        device_partitions: Per group, the partition in the compute dtype on the device.
        write_back: Stores a stepped sub-group's compute-dtype values instead of copying them
            into ``device_partitions`` (stage 3, whose partitions have homes of their own).
        device: The compute device; ``None``: that of ``device_partitions``.
        device_share: Sub-groups stepped on the device (partial offload, stage 3), ahead of
            ``subs``; it needs ``rule`` and a `HostState`.
    """

    def __init__(
        self,
        subs: Sequence[SubGroup],
        state: HostState | NvmeState,
        rule: AdamRule | None,
        views: list[Views],
        grad_staging: tuple[torch.Tensor, torch.Tensor],
        host_out: list[torch.Tensor],
        device_partitions: list[torch.Tensor],
        *,
        write_back: Callable[[SubGroup, torch.Tensor], None] | None = None,
        device: torch.device | None = None,
        device_share: DeviceShare | None = None,
    ) -> None:
        self.sub_groups = tuple(subs)
        self.device_share = device_share
        self.state = state
        self.views = views
        self.device_partitions = device_partitions
        self.grad_staging, self.host_out = grad_staging, host_out
        self._rule = rule
        self._steps = [0] * len(host_out)
        if device is None:
            device = device_partitions[0].device if device_partitions else torch.device("cpu")
        self._device = device
        self._stage3_write_back = write_back  # not a bound method: no cycle delays the finalizer
        self._async = device.type != "cpu"

    def _fence(self) -> Callable[[], None]:
        """Something to call that returns once the copies queued so far are done."""
        if not self._async:
            return _noop
        event = torch.Event(device=self._device)
        event.record()
        return event.synchronize

    def _to_host(
        self, k: int, sub: SubGroup, grads: Sequence[torch.Tensor]
    ) -> tuple[torch.Tensor, Callable[[], None]]:
        """Start copying sub-group ``k``'s gradient into staging buffer ``k % 2``: the buffer's
        view and a wait for the copy."""
        src = grads[sub.group][sub.start : sub.stop]
        host = self.grad_staging[k % 2][: src.numel()]
        host.copy_(src, non_blocking=self._async)
        return host, self._fence()

    def step(
        self, inner: torch.optim.Optimizer, grads: Sequence[torch.Tensor], factor: float
    ) -> None:
        """Apply this rank's gradient partitions (scaled by ``factor``) to the host masters.

        Args:
            inner: The inner optimizer (its param groups give the hyper-parameters).
            grads: This rank's fp32 gradient partitions on the device, changed in place.
            factor: Unscaling and clipping in one factor.
        """
        if factor != 1.0:
            for grad in grads:
                grad.mul_(factor)
        self._steps = [s + 1 for s in self._steps]
        if self.device_share is not None:
            assert self._rule is not None, "offload_problems refuses a partial offload without Adam"
            self.device_share.step(inner, grads, self._rule, self._steps, self._write_back)
        subs = self.sub_groups
        if not subs:
            return
        self.state.prefetch(subs[0])
        grad, ready = self._to_host(0, subs[0], grads)
        for k, sub in enumerate(subs):
            # the next copy goes into the other buffer; this one is free again once stepped
            following = self._to_host(k + 1, subs[k + 1], grads) if k + 1 < len(subs) else None
            ready()
            self._step_sub_group(inner, sub, grad)
            self._write_back(sub, self.host_out[sub.group][sub.start : sub.stop])
            if following is not None:
                grad, ready = following
        self.state.finish()
        self._fence()()  # the host buffers are rewritten next step: the copies must be done

    def _write_back(self, sub: SubGroup, out: torch.Tensor) -> None:
        if self._stage3_write_back is not None:
            self._stage3_write_back(sub, out)
            return
        target = self.device_partitions[sub.group][sub.start : sub.stop]
        target.copy_(out, non_blocking=self._async)

    def _step_sub_group(
        self, inner: torch.optim.Optimizer, sub: SubGroup, grad: torch.Tensor
    ) -> None:
        master, exp_avg, exp_avg_sq = self.state.acquire(sub)
        out = self.host_out[sub.group][sub.start : sub.stop]
        # a 16-bit master is its own 16-bit copy; an fp32 one writes the copy as it steps
        kernel_out = out if master.dtype == torch.float32 and out.dtype != master.dtype else None
        if self._rule is not None:
            assert exp_avg is not None and exp_avg_sq is not None, "Adam keeps moments"
            h = self._rule(inner.param_groups[sub.param_group])
            cpu_adam_step(
                master, grad, exp_avg, exp_avg_sq, step=self._steps[sub.group], lr=h.lr,
                beta1=h.beta1, beta2=h.beta2, eps=h.eps, weight_decay=h.weight_decay,
                adamw_mode=h.adamw_mode, bias_correction=h.bias_correction, param_out=kernel_out,
            )  # fmt: skip
        else:
            kernel_out = None
            self._step_inner(inner, sub, grad)
        if kernel_out is None and out.data_ptr() != master.data_ptr():
            out.copy_(master)
        self.state.release(sub)

    def _step_inner(self, inner: torch.optim.Optimizer, sub: SubGroup, grad: torch.Tensor) -> None:
        """Step the inner optimizer on this sub-group's views only (the others have no grad);
        ``grad`` holds the sub-group's elements, from ``sub.start``."""
        mine = [v for v in self.views[sub.group] if sub.start <= v[1] < sub.stop]
        for view, lo, hi in mine:
            assert hi <= sub.stop, "master views are cut at sub-group boundaries"
            view.grad = grad[lo - sub.start : hi - sub.start]
        inner.step()
        for view, _, _ in mine:
            view.grad = None

    def mirror_device_share(self) -> None:
        """Bring the host buffers' copy of the device share up to date (before reading them)."""
        if self.device_share is not None:
            assert isinstance(self.state, HostState), "a partial offload keeps host buffers"
            self.device_share.to_host(self.state)

    def reload_device_share(self) -> None:
        """Take the device share's values from the host buffers (after writing them)."""
        if self.device_share is not None:
            assert isinstance(self.state, HostState), "a partial offload keeps host buffers"
            self.device_share.from_host(self.state)

    def placement(self) -> tuple[tuple[SubGroup, str], ...]:
        """Every sub-group with where it steps: ``"device"`` (partial offload) or ``"host"``."""
        share = self.device_share.sub_groups if self.device_share is not None else ()
        return tuple((s, "device") for s in share) + tuple((s, "host") for s in self.sub_groups)

    @property
    def steps(self) -> list[int]:
        """Steps taken so far per group (the CPU Adam kernel's bias-correction count)."""
        return list(self._steps)

    def masters(self) -> tuple[torch.Tensor, ...]:
        """This rank's fp32 master partitions on the host (a fresh read for NVMe)."""
        self.mirror_device_share()
        return tuple(self.state.whole()[0])

    def state_dict(self) -> dict[str, Any]:
        """The step counts and, for the CPU Adam kernel, both moments as whole partitions."""
        saved: dict[str, Any] = {"steps": list(self._steps)}
        self.mirror_device_share()
        if self._rule is not None:
            _, exp_avg, exp_avg_sq = self.state.whole()
            saved["exp_avg"] = [t.clone() for t in exp_avg]
            saved["exp_avg_sq"] = [t.clone() for t in exp_avg_sq]
        return saved

    def load_state_dict(
        self, masters: Sequence[torch.Tensor], saved: dict[str, Any] | None
    ) -> None:
        """Restore masters and `state_dict`; refreshes the host and device partition copies.

        Raises:
            CheckpointError: The state was saved without offload, or with another optimizer.
        """
        keys = ("steps", "exp_avg", "exp_avg_sq") if self._rule is not None else ("steps",)
        if saved is None or any(key not in saved for key in keys):
            raise CheckpointError(
                "this ZeRO state dict has no offloaded optimizer state (saved without "
                "offload_optimizer or with another optimizer); load it into a run configured "
                "like the one that saved it"
            )
        states = [list(masters)]
        if self._rule is not None:
            states += [saved["exp_avg"], saved["exp_avg_sq"]]
        self.state.load(states)
        self.reload_device_share()
        self._steps = [int(s) for s in saved["steps"]]
        with torch.no_grad():
            for out, master in zip(self.host_out, masters, strict=True):
                if out.data_ptr() != master.data_ptr():
                    out.copy_(master)
            for sub in self.sub_groups:
                self._write_back(sub, self.host_out[sub.group][sub.start : sub.stop])
            if self.device_share is not None:
                self.device_share.write_all(self._write_back)
        self._fence()()

    def close(self) -> None:
        """Release the state's files (NVMe) and buffers."""
        self.state.close()


def _accelerator(device: torch.device) -> Any:
    return CpuAccelerator() if device.type == "cpu" else get_accelerator(device.type)


def _views(
    host_masters: Sequence[torch.Tensor] | None,
    subs: Sequence[SubGroup],
    groups: int,
    view_numel: int | None,
    kernel: bool,
) -> list[Views]:
    """What each inner param group holds: nothing for the CPU Adam kernel (the inner optimizer
    then only carries the hyper-parameters, so its state dict is the same for cpu and nvme),
    else views of at most ``view_numel`` cut inside every sub-group."""
    views: list[Views] = [[] for _ in range(groups)]
    if host_masters is None or kernel:
        return views
    for sub in subs:
        piece = host_masters[sub.group][sub.start : sub.stop]
        for view, lo, hi in master_views(piece, view_numel):
            views[sub.group].append((view, sub.start + lo, sub.start + hi))
    return views


def grad_staging(
    subs: Sequence[SubGroup], allocate: Allocate, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """The two host buffers the step pipeline stages gradients in, each as large as the largest
    sub-group (DeepSpeed keeps a whole fp32 gradient partition on the host instead): fp32 for
    the CPU Adam kernel (it reads any dtype), the masters' dtype for an optimizer stepped on
    host master views (a gradient must match its tensor)."""
    numel = max((sub.stop - sub.start for sub in subs), default=0)
    return allocate(numel, dtype), allocate(numel, dtype)


def build_offload(
    config: ZeroConfig,
    optimizer: torch.optim.Optimizer,
    masters: Sequence[torch.Tensor],
    flats: Sequence[FlatParams],
    aio: AioConfig | None,
    ranges: Sequence[tuple[int, int, int, int]],
    master_dtype: torch.dtype = torch.float32,
    state_dtype: torch.dtype | None = None,
) -> HostOffload | None:
    """The host side of optimizer offload, or ``None`` when the config has none.

    Copies the device master partitions to the host (or the files) and re-points the inner
    optimizer's param groups at host master views (or empties them, when the CPU Adam kernel
    steps); the device masters are then no longer needed.

    Args:
        config: The ``zero_optimization`` section (``offload_optimizer``, ``sub_group_size``);
            already checked by `deepshard.zero._offload_plan.offload_problems`.
        optimizer: The inner optimizer.
        masters: This rank's master partition of every group, on the device.
        flats: Every group's flat parameters (their buffer gives the compute dtype).
        aio: The ``aio`` section (NVMe); ``None`` for its defaults.
        ranges: ``(unit, lo, hi, param group)``: what each param group steps of each unit's
            partition (`deepshard.zero._master_views`, uncut).
        master_dtype: The host masters' dtype (fp32, or 16-bit masters).
        state_dtype: The moments' dtype (``bf16_optimizer_states``); None: `host_moment_dtype`.
    """
    section, kind = config.offload_optimizer, offload_device(config)
    if section is None or kind == "none":
        return None
    rule = adam_rule(optimizer)
    device = flats[0].buffer.device if flats else torch.device("cpu")
    allocate = host_allocator(_accelerator(device), section.pin_memory)
    numels = [m.numel() for m in masters]
    subs = plan_sub_groups(ranges, config.sub_group_size)
    moment_dtype = host_moment_dtype(optimizer, master_dtype, state_dtype)
    state: HostState | NvmeState
    host_masters: list[torch.Tensor] | None = None
    if kind == "nvme":
        # mkdtemp makes the directory unique per rank and optimizer; the pid says whose it is
        prefix, aio = f"zero-pid{os.getpid()}-", aio if aio is not None else AioConfig()
        state = NvmeState(masters, subs, section, aio, moment_dtype, allocate, prefix=prefix)
    else:
        host_masters = [
            allocate(n, master_dtype).copy_(m) for n, m in zip(numels, masters, strict=True)
        ]
        state = HostState(host_masters, moment_dtype if rule else None, allocate)
    dtypes = [flat.buffer.dtype for flat in flats]
    host_out = [
        host_masters[g]
        if host_masters is not None and dtype == master_dtype
        else allocate(n, dtype)
        for g, (n, dtype) in enumerate(zip(numels, dtypes, strict=True))
    ]
    device_partitions = [m.to(dtype, copy=True) for m, dtype in zip(masters, dtypes, strict=True)]
    view_numel = master_view_numel(optimizer, transformed=False)
    views = _views(host_masters, subs, len(masters), view_numel, kernel=rule is not None)
    groups: list[list[torch.Tensor]] = [[] for _ in optimizer.param_groups]
    for sub in subs:
        groups[sub.param_group] += [
            v for v, lo, hi in views[sub.group] if sub.start <= lo < sub.stop
        ]
    for param_group, held in zip(optimizer.param_groups, groups, strict=True):
        param_group["params"] = [view for view in held if view.numel()]
    staging = grad_staging(subs, allocate, torch.float32 if rule else master_dtype)
    return HostOffload(subs, state, rule, views, staging, host_out, device_partitions)
