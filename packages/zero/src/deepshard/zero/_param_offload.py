"""Where a stage-3 unit's parameter partition lives: the device, host memory, or an NVMe file.

Each unit has one *home* (``zero_optimization.offload_param``):

* `DeviceHome` (no offload): the partition is a device tensor; the all-gather reads it.
* `HostHome` (``device: "cpu"``): the partition is a host buffer (page-locked through the
  accelerator's ``pin_empty`` with ``pin_memory``). Gathering first copies it into a fresh
  device tensor (asynchronously on an accelerator), which the all-gather reads and which is
  dropped once the gather is done; the optimizer writes its updates into the host buffer.
* `NvmeHome` (``device: "nvme"``): the partition is in a file of the unit's `ParamSwap`
  between uses. Gathering reads it into one of ``buffer_count`` host buffers of
  ``buffer_size`` elements (`SwapPool`), copies that to a device tensor and gives the buffer
  back; the optimizer's updates are written into the file behind (waited for before the next
  read). The host never holds more partition bytes than the pool.

The fetcher's prefetch calls the unit's ``start_gather`` ahead of use, so the host-to-device
copy (and the file read) happen ahead too, right before the asynchronous all-gather is issued.
The read itself is synchronous within ``start_gather``: the all-gather needs its bytes.

On a CPU-only machine the host is the device, but the same path runs: the host buffers and
files are separate from the gathered buffers and every copy happens.

``max_in_cpu`` has no effect: DeepSpeed sizes a host copy of the parameters for its optimizer
with it, while here the offloaded optimizer writes its updates into the files directly and the
pool bounds the host memory used for parameters.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Protocol

import torch

from deepshard.accelerators import CpuAccelerator, get_accelerator
from deepshard.interface.accelerator import Accelerator
from deepshard.interface.config import AioConfig, OffloadParamConfig
from deepshard.interface.errors import CommError, ConfigError
from deepshard.zero._offload_state import Allocate, host_allocator
from deepshard.zero._swap import Swapper, SwapRequest

__all__ = [
    "DeviceHome",
    "HomeFactory",
    "HostHome",
    "NvmeHome",
    "ParamOffload",
    "PartitionHome",
    "SwapPool",
    "build_homes",
]

_KEY = "zero_optimization.offload_param"


@dataclass(frozen=True)
class ParamOffload:
    """Where stage-3 parameter partitions live between uses (``zero_optimization.offload_param``).

    Attributes:
        device: ``"cpu"`` (host buffers) or ``"nvme"`` (files under ``nvme_path``).
        nvme_path: Directory of the swap files (``"nvme"`` only).
        pin_memory: Page-lock the host buffers (where the accelerator can).
        buffer_count: ``"nvme"``: host buffers partitions are read into.
        buffer_size: ``"nvme"``: elements per host buffer; no unit partition may be larger.
        aio: Block size, depth and threads of the file I/O.
    """

    device: Literal["cpu", "nvme"]
    nvme_path: Path | None = None
    pin_memory: bool = True
    buffer_count: int = 5
    buffer_size: int = 100_000_000
    aio: AioConfig = field(default_factory=AioConfig)

    @classmethod
    def from_config(
        cls, section: OffloadParamConfig | None, aio: AioConfig | None = None
    ) -> ParamOffload | None:
        """The offload an ``offload_param`` section asks for; ``None`` for none."""
        if section is None or section.device == "none":
            return None
        return cls(
            device=section.device,
            nvme_path=section.nvme_path,
            pin_memory=section.pin_memory,
            buffer_count=section.buffer_count,
            buffer_size=section.buffer_size,
            aio=aio if aio is not None else AioConfig(),
        )


class PartitionHome(Protocol):
    """What a unit needs of the place its partition lives."""

    partition: torch.Tensor
    """The partition tensor (host or device); an NVMe home's has no bytes between uses."""

    def source(self) -> torch.Tensor:
        """The partition on the device, for the all-gather to read."""
        ...

    def read(self) -> torch.Tensor:
        """The partition's values (a fresh host tensor for NVMe)."""
        ...

    def write(self, values: torch.Tensor, start: int = 0) -> None:
        """Store ``values`` as elements ``start:`` of the partition."""
        ...

    def flush(self) -> None:
        """Wait for writes still in flight."""
        ...

    @property
    def device_bytes(self) -> int:
        """Bytes of the partition held in device memory."""
        ...

    def close(self) -> None:
        """Release files and buffers."""
        ...


HomeFactory = Callable[[int, torch.Tensor], PartitionHome]
"""``(unit index, partition on the device) ->`` the unit's home."""


def _check_resident(partition: torch.Tensor) -> None:
    if partition.numel() and partition.untyped_storage().nbytes() == 0:
        raise CommError(
            "a ZeRO stage-3 unit was gathered while its parameter partitions are offloaded "
            "(offload_states); call reload_states() before the forward"
        )


class DeviceHome:
    """The partition stays on the device (no parameter offload)."""

    def __init__(self, partition: torch.Tensor) -> None:
        self.partition = partition

    def source(self) -> torch.Tensor:
        """The partition itself.

        Raises:
            CommError: It was released by ``offload_states``.
        """
        _check_resident(self.partition)
        return self.partition

    def read(self) -> torch.Tensor:
        """The partition itself."""
        return self.partition

    def write(self, values: torch.Tensor, start: int = 0) -> None:
        """Copy ``values`` into the partition."""
        target = self.partition[start : start + values.numel()]
        target.copy_(values, non_blocking=target.device != values.device)

    def flush(self) -> None:
        """Nothing in flight."""

    @property
    def device_bytes(self) -> int:
        """The partition's bytes."""
        return self.partition.numel() * self.partition.element_size()

    def close(self) -> None:
        """Freed with the object."""


class HostHome(DeviceHome):
    """The partition lives in a host buffer and is copied to the device for each gather.

    Args:
        values: The partition's initial values (any device).
        allocate: Makes the host buffer.
        device: Where the gathered parameters live.
    """

    def __init__(self, values: torch.Tensor, allocate: Allocate, device: torch.device) -> None:
        super().__init__(allocate(values.numel(), values.dtype).copy_(values))
        self._device = device

    def source(self) -> torch.Tensor:
        """A new device copy of the host partition (asynchronous from pinned memory)."""
        _check_resident(self.partition)
        staging = torch.empty_like(self.partition, device=self._device)
        return staging.copy_(self.partition, non_blocking=self._device.type != "cpu")

    @property
    def device_bytes(self) -> int:
        """None: the partition is on the host."""
        return 0


def _fence(device: torch.device) -> Callable[[], None]:
    """Returns once the copies queued on ``device`` so far are done."""
    if device.type == "cpu":
        return lambda: None
    event = torch.Event(device=device)
    event.record()
    return event.synchronize


class SwapPool:
    """``count`` host buffers of ``numel`` elements that NVMe reads go through, round-robin.

    A buffer is given back with a fence (its device copy may still be running) and waited for
    before it is used again. Buffers are allocated on first use.
    """

    def __init__(self, count: int, numel: int, allocate: Allocate) -> None:
        self._count, self._numel, self._allocate = count, numel, allocate
        self._buffers: dict[tuple[int, torch.dtype], torch.Tensor] = {}
        self._fences: list[Callable[[], None] | None] = [None] * count
        self._next = 0

    def take(self, numel: int, dtype: torch.dtype) -> tuple[int, torch.Tensor]:
        """A free buffer's index and its first ``numel`` elements."""
        index, self._next = self._next, (self._next + 1) % self._count
        fence = self._fences[index]
        if fence is not None:
            fence()
            self._fences[index] = None
        key = (index, dtype)
        if key not in self._buffers:
            self._buffers[key] = self._allocate(self._numel, dtype)
        return index, self._buffers[key][:numel]

    def give(self, index: int, fence: Callable[[], None]) -> None:
        """Buffer ``index`` is free once ``fence()`` returns."""
        self._fences[index] = fence


class NvmeHome:
    """The partition lives in a file and is read through the pool for each gather.

    Args:
        index: The unit (names its file).
        values: The partition's initial values, written to the file.
        swapper: Owns the files.
        pool: The host buffers reads go through.
        device: Where the gathered parameters live.
    """

    def __init__(
        self,
        index: int,
        values: torch.Tensor,
        swapper: Swapper,
        pool: SwapPool,
        device: torch.device,
    ) -> None:
        self._name, self._swapper, self._pool, self._device = (
            f"unit{index}.param",
            swapper,
            pool,
            device,
        )
        self._pending: list[tuple[SwapRequest, torch.Tensor]] = []
        self._numel, self._dtype = values.numel(), values.dtype
        # the partition object exists for offload_states' and callers' sake; it holds no bytes
        self.partition = torch.empty(self._numel, dtype=values.dtype)
        self.partition.untyped_storage().resize_(0)
        self.write(values.detach().to("cpu", copy=True))
        self.flush()

    @property
    def file(self) -> Path:
        """The swap file."""
        return self._swapper.path(self._name)

    def source(self) -> torch.Tensor:
        """Read the file into a pool buffer and copy it to a new device tensor."""
        self.flush()
        index, buffer = self._pool.take(self._numel, self._dtype)
        self._swapper.read(self._name, buffer).wait()
        staging = torch.empty(self._numel, dtype=self._dtype, device=self._device)
        staging.copy_(buffer, non_blocking=self._device.type != "cpu")
        self._pool.give(index, _fence(self._device))
        return staging

    def read(self) -> torch.Tensor:
        """The partition's values, read into a new host tensor."""
        self.flush()
        out = torch.empty(self._numel, dtype=self._dtype)
        self._swapper.read(self._name, out).wait()
        return out

    def write(self, values: torch.Tensor, start: int = 0) -> None:
        """Write ``values`` (kept alive until flushed) into the file behind."""
        host = values if values.device.type == "cpu" else values.to("cpu")
        host = host.to(self._dtype).contiguous()
        offset = start * self._dtype.itemsize
        self._pending.append((self._swapper.write(self._name, host, offset=offset), host))

    def flush(self) -> None:
        """Wait for the writes in flight."""
        for request, _ in self._pending:
            request.wait()
        self._pending.clear()

    @property
    def device_bytes(self) -> int:
        """None: the partition is in a file."""
        return 0

    def close(self) -> None:
        """Remove the swap files (all units share them)."""
        self.flush()
        self._swapper.close()


def _accelerator(device: torch.device) -> Accelerator:
    return CpuAccelerator() if device.type == "cpu" else get_accelerator(device.type)


def _pool_problems(offload: ParamOffload, numels: Sequence[int]) -> list[tuple[str, str]]:
    problems = []
    if offload.buffer_count < 1:
        problems.append((f"{_KEY}.buffer_count", "must be >= 1 with device nvme"))
    largest = max(numels, default=0)
    if largest > offload.buffer_size:
        problems.append(
            (
                f"{_KEY}.buffer_size",
                f"is {offload.buffer_size} elements but a unit's partition has {largest}; "
                f"raise it to at least {largest} or cut the model into smaller units",
            )
        )
    return problems


def build_homes(
    offload: ParamOffload | None, numels: Sequence[int], device: torch.device
) -> HomeFactory:
    """The factory `UnitState` makes its home with, for partitions of ``numels`` elements.

    Raises:
        ConfigError: NVMe with ``buffer_count`` 0, a partition larger than ``buffer_size``, or
            an ``nvme_path`` that is not a writable directory.
    """
    if offload is None:
        return lambda index, partition: DeviceHome(partition)
    allocate = host_allocator(_accelerator(device), offload.pin_memory, key=_KEY)
    if offload.device == "cpu":
        return lambda index, partition: HostHome(partition, allocate, device)
    problems = _pool_problems(offload, numels)
    if problems:
        raise ConfigError.from_problems(problems)
    assert offload.nvme_path is not None, "the schema requires nvme_path with nvme"
    swapper = Swapper(
        Path(offload.nvme_path),
        offload.aio,
        prefix=f"zero3-params-pid{os.getpid()}-",
        key=f"{_KEY}.nvme_path",
    )
    pool = SwapPool(offload.buffer_count, max(numels, default=0), allocate)
    return lambda index, partition: NvmeHome(index, partition, swapper, pool, device)
