"""torch_info(): versions, with None where a build lacks a component or cannot report it."""

from __future__ import annotations

import pytest
import torch

from deepshard.accelerators import CpuAccelerator, CudaAccelerator, torch_info


def test_reports_this_torch():
    info = torch_info()
    assert set(info) == {"torch", "cuda", "hip", "nccl"}
    assert info["torch"] == str(torch.__version__)
    assert info["cuda"] == torch.version.cuda
    assert info["hip"] == torch.version.hip
    assert CpuAccelerator().torch_info() == info == CudaAccelerator().torch_info()


@pytest.mark.parametrize("error", [RuntimeError, AttributeError, ImportError, TypeError])
def test_nccl_lookup_failure_gives_none(error, monkeypatch):
    def broken() -> tuple[int, int, int]:
        raise error("this build has no NCCL")

    monkeypatch.setattr(torch.cuda.nccl, "version", broken)
    info = torch_info()
    assert info["nccl"] is None
    assert info["torch"] == str(torch.__version__)


@pytest.mark.parametrize(("reported", "expected"), [((2, 21, 5), "2.21.5"), (2708, "2708")])
def test_nccl_version_is_normalised_to_a_string(reported, expected, monkeypatch):
    monkeypatch.setattr(torch.cuda.nccl, "version", lambda: reported)
    assert torch_info()["nccl"] == expected


def test_source_build_without_version_attributes(monkeypatch):
    monkeypatch.delattr(torch.version, "cuda")
    monkeypatch.delattr(torch.version, "hip")
    info = torch_info()
    assert info["cuda"] is None
    assert info["hip"] is None


def test_cpu_only_build_reports_no_cuda(monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", None)
    assert torch_info()["cuda"] is None


def test_source_build_fallback_still_reports_nccl(monkeypatch):
    # A source build may lack torch.version.cuda/hip; the NCCL version comes from the library
    # itself (torch.cuda.nccl), so the fallback keeps it (DeepSpeed v0.19.7's fix).
    monkeypatch.delattr(torch.version, "cuda")
    monkeypatch.delattr(torch.version, "hip")
    monkeypatch.setattr(torch.cuda.nccl, "version", lambda: (2, 27, 3))
    info = torch_info()
    assert info == {"torch": str(torch.__version__), "cuda": None, "hip": None, "nccl": "2.27.3"}
