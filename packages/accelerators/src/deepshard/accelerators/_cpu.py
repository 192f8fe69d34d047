"""The CPU as an accelerator: the fallback when no device is usable, and what tests run on.

Decisions, each documented on the method:

* One device. All ranks on a host share "cpu"; `CpuAccelerator.bind_local_rank` binds
  nothing and `CpuAccelerator.device` accepts any non-negative index.
* No allocator statistics. The CPU has no device allocator; process RSS measures something else
  (every library's memory, fragmentation, the page cache), so the memory methods return ``None``.
* No pinning. Page-locking needs a device driver; the ``pin_*`` methods return ordinary memory.
"""

from __future__ import annotations

import torch

from deepshard.accelerators._base import AcceleratorBase
from deepshard.accelerators._errors import AcceleratorError

__all__ = ["CpuAccelerator"]


def _check_index(index: int, what: str) -> None:
    if isinstance(index, bool) or not isinstance(index, int) or index < 0:
        raise AcceleratorError(f"{what} must be a non-negative int, got {index!r}.")


class CpuAccelerator(AcceleratorBase):
    """Runs everything on the host CPU and communicates over gloo."""

    @property
    def name(self) -> str:
        """Always ``"cpu"``."""
        return "cpu"

    @property
    def communication_backend(self) -> str:
        """Always ``"gloo"``, the torch.distributed backend for CPU tensors."""
        return "gloo"

    def _pins_host_memory(self) -> bool:
        return False

    def device_count(self) -> int:
        """Always 1: the CPU is one device shared by every rank on the host."""
        return 1

    def current_device(self) -> torch.device:
        """Always ``torch.device("cpu")``."""
        return torch.device("cpu")

    def device(self, index: int | None = None) -> torch.device:
        """``torch.device("cpu")`` for any index: ranks share the one CPU device.

        Raises:
            AcceleratorError: ``index`` is negative or not an int.
        """
        if index is not None:
            _check_index(index, "device index")
        return torch.device("cpu")

    def synchronize(self, device: torch.device | int | None = None) -> None:
        """Nothing to wait for: CPU operators finish before they return."""

    def bind_local_rank(self, local_rank: int) -> torch.device:
        """Bind nothing (the CPU has no per-rank device) and return ``torch.device("cpu")``.

        Raises:
            AcceleratorError: ``local_rank`` is negative or not an int.
        """
        _check_index(local_rank, "local_rank")
        return torch.device("cpu")

    def memory_stats(self) -> dict[str, int] | None:
        """``None``: the CPU has no device allocator to report on."""
        return None

    def memory_allocated(self) -> int | None:
        """``None``: the CPU has no device allocator to report on."""
        return None

    def max_memory_allocated(self) -> int | None:
        """``None``: the CPU has no device allocator to report on."""
        return None

    def reset_peak_memory_stats(self) -> None:
        """Nothing to reset: no peak is tracked on the CPU."""

    def is_bf16_supported(self) -> bool:
        """True: torch implements bfloat16 for every CPU operator used in training."""
        return True

    def set_device(self, device_index: int) -> None:
        """Nothing to select (ranks share the one CPU device); the index is still checked.

        Raises:
            AcceleratorError: ``device_index`` is negative or not an int.
        """
        _check_index(device_index, "device index")

    def manual_seed(self, seed: int) -> None:
        """Seed torch's CPU generator (DeepSpeed's CPU accelerator does the same)."""
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        """As `manual_seed`: the CPU is one device."""
        torch.manual_seed(seed)

    def empty_cache(self) -> None:
        """Nothing to release: the CPU allocator keeps no device cache."""

    def is_fp16_supported(self) -> bool:
        """False: float16 mixed precision with loss scaling is a device feature; use bf16 on CPU."""
        return False
