"""bind_local_rank, device() and synchronize(): bind only when there is a choice to make."""

from __future__ import annotations

import pytest
import torch

from deepshard.accelerators import (
    AcceleratorError,
    CpuAccelerator,
    CudaAccelerator,
    MpsAccelerator,
    XpuAccelerator,
)

DEVICE_CLASSES = [CudaAccelerator, MpsAccelerator, XpuAccelerator]


@pytest.mark.parametrize("cls", DEVICE_CLASSES)
@pytest.mark.parametrize("local_rank", [0, 1, 3])
def test_several_devices_bind_the_local_rank(cls, local_rank, fake_device):
    accelerator = cls()
    fake = fake_device(accelerator.name, count=4)
    device = accelerator.bind_local_rank(local_rank)
    assert fake.set_calls == [local_rank]
    assert device == torch.device(accelerator.name, local_rank)
    assert accelerator.current_device() == device


@pytest.mark.parametrize("cls", DEVICE_CLASSES)
@pytest.mark.parametrize("local_rank", [0, 5])
def test_one_visible_device_binds_nothing(cls, local_rank, fake_device):
    accelerator = cls()
    fake = fake_device(accelerator.name, count=1)
    assert accelerator.bind_local_rank(local_rank) == torch.device(accelerator.name, 0)
    assert fake.set_calls == []


def test_local_rank_beyond_the_visible_devices_is_an_error(fake_device):
    fake = fake_device("cuda", count=2)
    with pytest.raises(AcceleratorError, match=r"local_rank 2 .* 2 are visible") as caught:
        CudaAccelerator().bind_local_rank(2)
    assert "CUDA_VISIBLE_DEVICES" in str(caught.value)
    assert fake.set_calls == []


@pytest.mark.parametrize("bad", [-1, True, 1.0])
def test_local_rank_must_be_a_non_negative_int(bad, fake_device):
    fake_device("cuda", count=2)
    with pytest.raises(AcceleratorError, match="local_rank"):
        CudaAccelerator().bind_local_rank(bad)
    with pytest.raises(AcceleratorError, match="local_rank"):
        CpuAccelerator().bind_local_rank(bad)


@pytest.mark.parametrize("local_rank", [0, 1, 7])
def test_cpu_never_binds(local_rank, monkeypatch):
    def forbidden(*args: object) -> None:
        raise AssertionError("the CPU accelerator must not select a device")

    monkeypatch.setattr(torch.accelerator, "set_device_index", forbidden)
    monkeypatch.setattr(torch.accelerator, "device_count", lambda: 4)
    assert CpuAccelerator().bind_local_rank(local_rank) == torch.device("cpu")


def test_device_index_defaults_to_the_current_device(fake_device):
    fake = fake_device("cuda", count=3)
    fake.current_index = 2
    accelerator = CudaAccelerator()
    assert accelerator.device() == torch.device("cuda", 2)
    assert accelerator.device(1) == torch.device("cuda", 1)
    assert accelerator.device_count() == 3


@pytest.mark.parametrize("bad", [-1, 3])
def test_device_index_must_be_visible(bad, fake_device):
    fake_device("cuda", count=3)
    with pytest.raises(AcceleratorError, match=r"device index .* 3 are visible \(0\.\.2\)"):
        CudaAccelerator().device(bad)


def test_cpu_is_one_device_shared_by_every_rank():
    cpu = CpuAccelerator()
    assert cpu.device_count() == 1
    assert cpu.current_device() == torch.device("cpu")
    assert cpu.device() == cpu.device(0) == cpu.device(3) == torch.device("cpu")
    with pytest.raises(AcceleratorError, match="device index"):
        cpu.device(-1)


def test_synchronize_goes_through_torch_accelerator(fake_device):
    fake = fake_device("cuda", count=2)
    CudaAccelerator().synchronize()
    CudaAccelerator().synchronize(1)
    assert fake.sync_calls == [None, 1]


def test_cpu_synchronize_touches_no_device(monkeypatch):
    def forbidden(*args: object) -> None:
        raise AssertionError("the CPU accelerator must not synchronize a device")

    monkeypatch.setattr(torch.accelerator, "synchronize", forbidden)
    CpuAccelerator().synchronize()
