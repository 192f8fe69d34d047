"""Without the compiled extension the ops run their pure-torch twins after exactly one warning."""

from __future__ import annotations

import importlib
import warnings

import pytest
import torch

import deepshard.kernels as kernels
from deepshard.kernels import _extension

ADAM = {"lr": 1e-3, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.01}
LION = {"lr": 1e-4, "beta1": 0.9, "beta2": 0.99, "weight_decay": 0.1}


def _buffers(numel: int = 100) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    param, grad, exp_avg, exp_avg_sq = (torch.randn(numel, generator=gen) for _ in range(4))
    return [param, grad, exp_avg, exp_avg_sq.abs()]


def _runtime_warnings(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]


def test_missing_extension_warns_once_and_gives_the_twin_result(monkeypatch):
    loader = _extension.ExtensionLoader("deepshard.kernels._no_such_extension")
    monkeypatch.setattr(_extension, "CPU_EXTENSION", loader)
    ours, twin = _buffers(), _buffers()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in (1, 2):
            kernels.cpu_adam_step(*ours, step=step, **ADAM)
        kernels.cpu_lion_step(ours[0], ours[1], ours[2], **LION)
    messages = _runtime_warnings(caught)
    assert len(messages) == 1, messages
    assert "deepshard.kernels._no_such_extension" in messages[0]
    assert "ModuleNotFoundError" in messages[0]
    for step in (1, 2):
        kernels.reference_adam_step(*twin, step=step, **ADAM)
    kernels.reference_lion_step(twin[0], twin[1], twin[2], **LION)
    for a, b in zip(ours, twin, strict=True):
        assert torch.equal(a, b)


def test_report_and_path_selection_say_why(monkeypatch):
    loader = _extension.ExtensionLoader("deepshard.kernels._no_such_extension")
    monkeypatch.setattr(_extension, "CPU_EXTENSION", loader)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        report = kernels.kernel_report()
    for name in ("cpu_adam_step", "cpu_lion_step"):
        op = report.op(name)
        assert not op.compiled and op.backend == "reference"
        assert op.fallback_reason is not None and "ModuleNotFoundError" in op.fallback_reason
    assert kernels.active_simd_path() == "reference"
    assert kernels.available_simd_paths() == ()
    with pytest.raises(RuntimeError, match="extension is unavailable"):
        kernels.use_simd_path("scalar").__enter__()


def test_a_broken_shared_library_also_falls_back(monkeypatch):
    def broken(name: str) -> object:
        raise OSError(f"{name}: undefined symbol: _ZN9deepshard3cpu9adam_sve")

    loader = _extension.ExtensionLoader("deepshard.kernels._cpu")
    monkeypatch.setattr(_extension, "CPU_EXTENSION", loader)
    monkeypatch.setattr(importlib, "import_module", broken)
    ours = _buffers()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        kernels.cpu_adam_step(*ours, step=1, **ADAM)
    monkeypatch.undo()
    messages = _runtime_warnings(caught)
    assert len(messages) == 1 and "undefined symbol" in messages[0]
    assert loader.failure() is not None and loader.failure().startswith("OSError")
