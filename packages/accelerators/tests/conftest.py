"""A fake device: patches torch's public device checks so the cuda/mps/xpu paths run on CPU."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch


class FakeTorchDevice:
    """Stands in for the one accelerator a torch build targets, recording what is asked of it."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, kind: str | None, count: int) -> None:
        self.kind = kind
        self.count = count
        self.current_index = 0
        self.set_calls: list[object] = []
        self.sync_calls: list[object] = []
        mp = monkeypatch
        mp.setattr(torch.cuda, "is_available", lambda: kind == "cuda")
        mp.setattr(torch.backends.mps, "is_available", lambda: kind == "mps")
        mp.setattr(torch.xpu, "is_available", lambda: kind == "xpu")
        mp.setattr(torch.accelerator, "current_accelerator", self._current_accelerator)
        mp.setattr(torch.accelerator, "is_available", lambda: kind is not None)
        mp.setattr(torch.accelerator, "device_count", lambda: count)
        mp.setattr(torch.accelerator, "current_device_index", lambda: self.current_index)
        mp.setattr(torch.accelerator, "set_device_index", self._set_device_index)
        mp.setattr(torch.accelerator, "synchronize", self.sync_calls.append)

    def _current_accelerator(self, check_available: bool = False) -> torch.device | None:
        return None if self.kind is None else torch.device(self.kind)

    def _set_device_index(self, index: object) -> None:
        self.set_calls.append(index)
        assert isinstance(index, int)
        self.current_index = index


@pytest.fixture
def fake_device(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., FakeTorchDevice]]:
    """Factory: ``fake_device("cuda", count=2)`` makes torch report that device (``None``: none)."""

    def make(kind: str | None, count: int = 1) -> FakeTorchDevice:
        return FakeTorchDevice(monkeypatch, kind, count)

    yield make
