"""Communication backend and dtype support flags, per accelerator."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from deepshard.accelerators import (
    CpuAccelerator,
    CudaAccelerator,
    MpsAccelerator,
    XpuAccelerator,
)


def test_cpu_and_mps_communicate_over_gloo():
    assert CpuAccelerator().communication_backend == "gloo"
    assert MpsAccelerator().communication_backend == "gloo"


@pytest.mark.parametrize(("has_nccl", "expected"), [(True, "nccl"), (False, "gloo")])
def test_cuda_uses_nccl_where_torch_has_it(has_nccl, expected, monkeypatch):
    monkeypatch.setattr(dist, "is_nccl_available", lambda: has_nccl)
    assert CudaAccelerator().communication_backend == expected


@pytest.mark.parametrize(("has_xccl", "expected"), [(True, "xccl"), (False, "gloo")])
def test_xpu_uses_xccl_where_torch_has_it(has_xccl, expected, monkeypatch):
    monkeypatch.setattr(dist, "is_xccl_available", lambda: has_xccl, raising=False)
    assert XpuAccelerator().communication_backend == expected


def test_xpu_falls_back_to_gloo_on_a_torch_without_the_xccl_check(monkeypatch):
    monkeypatch.delattr(dist, "is_xccl_available", raising=False)
    assert XpuAccelerator().communication_backend == "gloo"


@pytest.mark.parametrize(("capability", "fp16"), [((6, 1), False), ((7, 0), True), ((9, 0), True)])
def test_cuda_fp16_needs_volta(capability, fp16, monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *args: capability)
    assert CudaAccelerator().is_fp16_supported() is fp16


@pytest.mark.parametrize("native", [True, False])
def test_cuda_bf16_counts_native_support_only(native, monkeypatch):
    asked: list[bool] = []

    def is_bf16_supported(including_emulation: bool = True) -> bool:
        asked.append(including_emulation)
        return native if not including_emulation else True

    monkeypatch.setattr(torch.cuda, "is_bf16_supported", is_bf16_supported)
    assert CudaAccelerator().is_bf16_supported() is native
    assert asked == [False]


@pytest.mark.parametrize(("sonoma", "expected"), [(True, True), (False, False)])
def test_mps_bf16_needs_macos_14(sonoma, expected, monkeypatch):
    asked: list[tuple[int, int]] = []

    def is_macos_or_newer(major: int, minor: int) -> bool:
        asked.append((major, minor))
        return sonoma

    monkeypatch.setattr(torch.backends.mps, "is_macos_or_newer", is_macos_or_newer)
    assert MpsAccelerator().is_bf16_supported() is expected
    assert asked == [(14, 0)]
    assert MpsAccelerator().is_fp16_supported()


@pytest.mark.parametrize("reported", [True, False])
def test_xpu_bf16_is_what_torch_reports(reported, monkeypatch):
    monkeypatch.setattr(torch.xpu, "is_bf16_supported", lambda *args, **kwargs: reported)
    assert XpuAccelerator().is_bf16_supported() is reported
    assert XpuAccelerator().is_fp16_supported()


def test_cpu_trains_in_bf16_not_fp16():
    assert CpuAccelerator().is_bf16_supported()
    assert not CpuAccelerator().is_fp16_supported()
