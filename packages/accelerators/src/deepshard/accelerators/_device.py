"""Accelerators with real devices (cuda, mps, xpu), written against ``torch.accelerator``.

``torch.accelerator`` (torch >= 2.6) addresses the one accelerator a torch build targets, so the
device count, current device, binding and synchronisation are written once here. Only what it
has no equivalent for lives in the subclasses: the communication backend and the dtype checks.
Memory statistics come from ``torch.accelerator`` where this torch has them, else from
the device module (``torch.cuda``/``torch.xpu``/``torch.mps``).

Instances are made by `deepshard.accelerators.get_accelerator`, which first checks that the
device is usable; constructing a class directly skips that check.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from deepshard.accelerators._base import AcceleratorBase
from deepshard.accelerators._errors import AcceleratorError

__all__ = ["CudaAccelerator", "DeviceAccelerator", "MpsAccelerator", "XpuAccelerator"]

_VISIBLE_DEVICES_VAR = {
    "cuda": "CUDA_VISIBLE_DEVICES",
    "xpu": "ZE_AFFINITY_MASK",
    "mps": "(none: a Mac has one GPU)",
}


class DeviceAccelerator(AcceleratorBase):
    """What cuda, mps and xpu share: every query goes through ``torch.accelerator``."""

    def _pins_host_memory(self) -> bool:
        return True

    def device_count(self) -> int:
        """Number of devices of this kind visible to the process."""
        return torch.accelerator.device_count()

    def current_device(self) -> torch.device:
        """The current device, with its index."""
        return torch.device(self.name, torch.accelerator.current_device_index())

    def device(self, index: int | None = None) -> torch.device:
        """The device with ``index``, or the current device when ``index`` is ``None``.

        Raises:
            AcceleratorError: ``index`` is not one of the visible devices.
        """
        if index is None:
            return self.current_device()
        self._check_visible(index, "device index")
        return torch.device(self.name, index)

    def synchronize(self, device: torch.device | int | None = None) -> None:
        """Block until all queued work on ``device`` (default: the current one) has finished."""
        torch.accelerator.synchronize(device)

    def bind_local_rank(self, local_rank: int) -> torch.device:
        """Make ``local_rank``'s device current, but only when several devices are visible.

        With one visible device (the launcher already narrowed visibility per rank, or the host
        has one GPU) there is nothing to choose: device 0 is returned and nothing is bound.

        Args:
            local_rank: The rank of this process on its host (``LOCAL_RANK``).

        Returns:
            The device this rank should use.

        Raises:
            AcceleratorError: ``local_rank`` is negative, or there are fewer visible devices than
                ``local_rank + 1`` while several are visible.
        """
        if isinstance(local_rank, bool) or not isinstance(local_rank, int) or local_rank < 0:
            raise AcceleratorError(f"local_rank must be a non-negative int, got {local_rank!r}.")
        if self.device_count() <= 1:
            return torch.device(self.name, 0)
        self._check_visible(local_rank, "local_rank")
        torch.accelerator.set_device_index(local_rank)
        return torch.device(self.name, local_rank)

    def set_device(self, device_index: int) -> None:
        """Make device ``device_index`` current (DeepSpeed's ``set_device``).

        Raises:
            AcceleratorError: ``device_index`` is not one of the visible devices.
        """
        self._check_visible(device_index, "device index")
        torch.accelerator.set_device_index(device_index)

    def is_available(self) -> bool:
        """Whether at least one device of this kind is visible."""
        return self.device_count() > 0

    def manual_seed(self, seed: int) -> None:
        """Seed the current device's generator (not the CPU's), as DeepSpeed does."""
        torch.get_device_module(self.name).manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        """Seed the generators of every visible device of this kind."""
        module = torch.get_device_module(self.name)
        getattr(module, "manual_seed_all", module.manual_seed)(seed)

    def empty_cache(self) -> None:
        """Return the cached, unused device memory to the driver."""
        self._memory_function("empty_cache")()

    def _check_visible(self, index: int, what: str) -> None:
        count = self.device_count()
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < count:
            raise AcceleratorError(
                f"{what} {index!r} does not name a visible {self.name} device: {count} are "
                f"visible (0..{count - 1}). Start at most {count} ranks per host, or check "
                f"{_VISIBLE_DEVICES_VAR[self.name]}."
            )

    def _memory_function(self, function: str) -> Callable[..., Any]:
        """``torch.accelerator.<function>`` if this torch has it, else the device module's."""
        for module in (torch.accelerator, getattr(torch, self.name, None)):
            found = getattr(module, function, None)
            if found is not None:
                return found  # type: ignore[no-any-return]
        raise AcceleratorError(
            f"torch {torch.__version__} offers no {function} for {self.name}; "
            "upgrade torch, whose torch.accelerator offers it in recent releases."
        )

    def memory_stats(self) -> dict[str, int] | None:
        """The current device's allocator statistics (empty before its first allocation)."""
        stats = self._memory_function("memory_stats")()
        return {str(key): int(value) for key, value in stats.items()}

    def memory_allocated(self) -> int | None:
        """Bytes currently held by tensors on the current device."""
        return int(self._memory_function("memory_allocated")())

    def max_memory_allocated(self) -> int | None:
        """Peak bytes held by tensors on the current device since start or the last reset."""
        return int(self._memory_function("max_memory_allocated")())

    def reset_peak_memory_stats(self) -> None:
        """Restart peak tracking on the current device."""
        self._memory_function("reset_peak_memory_stats")()


class CudaAccelerator(DeviceAccelerator):
    """NVIDIA GPUs, and AMD GPUs through ROCm (torch presents both as ``cuda``)."""

    @property
    def name(self) -> str:
        """Always ``"cuda"``."""
        return "cuda"

    @property
    def communication_backend(self) -> str:
        """``"nccl"`` (RCCL on ROCm); ``"gloo"`` where torch was built without it (Windows)."""
        return "nccl" if dist.is_available() and dist.is_nccl_available() else "gloo"

    def is_bf16_supported(self) -> bool:
        """Native bfloat16 (Ampere or newer); emulated support does not count."""
        return bool(torch.cuda.is_bf16_supported(including_emulation=False))

    def is_fp16_supported(self) -> bool:
        """Compute capability 7.0 (Volta) or newer: the first GPUs with fp16 tensor cores."""
        major, _ = torch.cuda.get_device_capability()
        return major >= 7


class MpsAccelerator(DeviceAccelerator):
    """Apple silicon GPUs through Metal Performance Shaders (one device, gloo between ranks)."""

    @property
    def name(self) -> str:
        """Always ``"mps"``."""
        return "mps"

    @property
    def communication_backend(self) -> str:
        """Always ``"gloo"``: torch has no collective backend for MPS tensors."""
        return "gloo"

    def is_bf16_supported(self) -> bool:
        """bfloat16 on MPS needs macOS 14 (Sonoma) or newer."""
        is_macos_or_newer = getattr(torch.backends.mps, "is_macos_or_newer", None)
        return bool(is_macos_or_newer is not None and is_macos_or_newer(14, 0))

    def is_fp16_supported(self) -> bool:
        """True: every MPS device computes in float16."""
        return True


class XpuAccelerator(DeviceAccelerator):
    """Intel GPUs through torch's built-in ``xpu`` device."""

    @property
    def name(self) -> str:
        """Always ``"xpu"``."""
        return "xpu"

    @property
    def communication_backend(self) -> str:
        """``"xccl"`` where torch was built with it, else ``"gloo"``."""
        is_xccl_available = getattr(dist, "is_xccl_available", None)
        has_xccl = dist.is_available() and is_xccl_available is not None and is_xccl_available()
        return "xccl" if has_xccl else "gloo"

    def is_bf16_supported(self) -> bool:
        """What ``torch.xpu.is_bf16_supported()`` reports (True where torch lacks the check)."""
        check = getattr(torch.xpu, "is_bf16_supported", None)
        return True if check is None else bool(check())

    def is_fp16_supported(self) -> bool:
        """True: every Intel GPU torch supports computes in float16."""
        return True
