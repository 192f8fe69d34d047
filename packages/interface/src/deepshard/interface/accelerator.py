"""The device contract every DeepShard package codes against.

`deepshard.accelerators.get_accelerator()` returns an object that satisfies `Accelerator`;
code above it (comm, zero, the engine) depends on this protocol, not on a concrete class, so a
test can hand in a fake. The protocol is ``runtime_checkable``: ``isinstance(obj, Accelerator)``
checks that every member is present (not their signatures).

This module never imports torch at runtime (``deepshard.interface`` must stay light); the torch
types below are annotations only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

__all__ = ["Accelerator"]


@runtime_checkable
class Accelerator(Protocol):
    """One kind of compute device (``cpu``, ``cuda``, ``mps`` or ``xpu``) as seen by one process.

    Implementations hold no mutable state: every query goes to torch, so two instances of the same
    kind are interchangeable.
    """

    @property
    def name(self) -> str:
        """The torch device type: ``"cpu"``, ``"cuda"``, ``"mps"`` or ``"xpu"``."""
        ...

    @property
    def communication_backend(self) -> str:
        """The ``torch.distributed`` backend: ``"gloo"``, ``"nccl"`` or ``"xccl"``."""
        ...

    def device_count(self) -> int:
        """Number of devices of this kind visible to the process (``1`` for the CPU)."""
        ...

    def current_device(self) -> torch.device:
        """The device this process currently runs on, with its index when it has one."""
        ...

    def device(self, index: int | None = None) -> torch.device:
        """The device with ``index``, or the current device when ``index`` is ``None``."""
        ...

    def synchronize(self, device: torch.device | int | None = None) -> None:
        """Wait until all queued work on ``device`` (default: the current one) has finished."""
        ...

    def bind_local_rank(self, local_rank: int) -> torch.device:
        """Make ``local_rank``'s device current when several are visible; return the device used."""
        ...

    def memory_stats(self) -> dict[str, int] | None:
        """The device allocator's statistics, or ``None`` where no device allocator exists."""
        ...

    def memory_allocated(self) -> int | None:
        """Bytes currently held by tensors on the current device, or ``None`` on the CPU."""
        ...

    def max_memory_allocated(self) -> int | None:
        """Peak of `memory_allocated` since start or last reset; ``None`` on the CPU."""
        ...

    def reset_peak_memory_stats(self) -> None:
        """Restart peak tracking for `max_memory_allocated`."""
        ...

    def pin_memory(self, tensor: torch.Tensor) -> torch.Tensor:
        """Return the CPU ``tensor`` in page-locked host memory where the device allows it."""
        ...

    def pin_empty(self, *size: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Allocate an uninitialised host tensor, page-locked where the device allows it."""
        ...

    def pin_empty_like(self, tensor: torch.Tensor) -> torch.Tensor:
        """Like `pin_empty` with the shape and dtype of the CPU tensor ``tensor``."""
        ...

    def is_bf16_supported(self) -> bool:
        """Whether bfloat16 training is supported on this device."""
        ...

    def is_fp16_supported(self) -> bool:
        """Whether float16 mixed-precision training is supported on this device."""
        ...

    def torch_info(self) -> dict[str, str | None]:
        """Versions of torch and its device stack (``None`` for a part the build lacks)."""
        ...
