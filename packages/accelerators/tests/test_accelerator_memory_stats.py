"""Memory statistics: allocator-backed only, None on the CPU, torch.accelerator first."""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch

from deepshard.accelerators import AcceleratorError, CpuAccelerator, CudaAccelerator

MEMORY_FUNCTIONS = (
    "memory_stats",
    "memory_allocated",
    "max_memory_allocated",
    "reset_peak_memory_stats",
)


def test_cpu_reports_no_allocator_statistics():
    allocated = torch.zeros(1 << 16)  # host memory is in use, yet no statistic is reported
    cpu = CpuAccelerator()
    assert cpu.memory_stats() is None
    assert cpu.memory_allocated() is None
    assert cpu.max_memory_allocated() is None
    cpu.reset_peak_memory_stats()
    assert cpu.max_memory_allocated() is None
    del allocated


class FakeAllocator:
    """Counts bytes like a device allocator would."""

    def __init__(self) -> None:
        self.allocated = 0
        self.peak = 0

    def allocate(self, size: int) -> None:
        self.allocated += size
        self.peak = max(self.peak, self.allocated)

    def free(self, size: int) -> None:
        self.allocated -= size

    def install(self, monkeypatch: pytest.MonkeyPatch, module: object) -> None:
        monkeypatch.setattr(module, "memory_stats", self._stats, raising=False)
        monkeypatch.setattr(module, "memory_allocated", lambda: self.allocated, raising=False)
        monkeypatch.setattr(module, "max_memory_allocated", lambda: self.peak, raising=False)
        monkeypatch.setattr(module, "reset_peak_memory_stats", self._reset, raising=False)

    def _stats(self) -> OrderedDict[str, int]:
        current, peak = self.allocated, self.peak
        return OrderedDict(
            [("allocated_bytes.all.current", current), ("allocated_bytes.all.peak", peak)]
        )

    def _reset(self) -> None:
        self.peak = self.allocated


def _exercise(accelerator: CudaAccelerator, allocator: FakeAllocator) -> None:
    allocator.allocate(100)
    allocator.allocate(50)
    allocator.free(120)
    assert accelerator.memory_allocated() == 30
    assert accelerator.max_memory_allocated() == 150
    assert accelerator.memory_stats() == {
        "allocated_bytes.all.current": 30,
        "allocated_bytes.all.peak": 150,
    }
    accelerator.reset_peak_memory_stats()
    assert accelerator.max_memory_allocated() == 30


def test_device_statistics_come_from_torch_accelerator(monkeypatch):
    allocator = FakeAllocator()
    allocator.install(monkeypatch, torch.accelerator)

    def forbidden() -> None:
        raise AssertionError("torch.cuda must not be asked when torch.accelerator answers")

    for function in MEMORY_FUNCTIONS:
        monkeypatch.setattr(torch.cuda, function, forbidden)
    _exercise(CudaAccelerator(), allocator)


def test_device_statistics_fall_back_to_the_device_module(monkeypatch):
    for function in MEMORY_FUNCTIONS:
        monkeypatch.delattr(torch.accelerator, function, raising=False)
    allocator = FakeAllocator()
    allocator.install(monkeypatch, torch.cuda)
    _exercise(CudaAccelerator(), allocator)


def test_missing_statistics_say_which_torch_is_needed(monkeypatch):
    monkeypatch.delattr(torch.accelerator, "max_memory_allocated")
    monkeypatch.delattr(torch.cuda, "max_memory_allocated")
    with pytest.raises(AcceleratorError, match=r"no max_memory_allocated for cuda.*upgrade torch"):
        CudaAccelerator().max_memory_allocated()
