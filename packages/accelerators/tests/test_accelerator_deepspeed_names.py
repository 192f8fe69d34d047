"""DeepSpeed's accelerator method names work on DeepShard's accelerators.

Scripts written for DeepSpeed call ``get_accelerator().device_name(local_rank)``,
``current_device_name()``, ``manual_seed_all(seed)``, ``empty_cache()``, ``set_device(i)``,
``communication_backend_name()`` and ``on_accelerator(t)``. Checked on the CPU accelerator
(what this machine has) and, where no device is needed, on the device accelerators.
"""

from __future__ import annotations

import pytest
import torch

from deepshard.accelerators import AcceleratorError, CpuAccelerator, CudaAccelerator


def test_cpu_answers_deepspeed_names() -> None:
    cpu = CpuAccelerator()
    assert (cpu.device_name(), cpu.device_name(0), cpu.current_device_name()) == ("cpu",) * 3
    assert cpu.communication_backend_name() == "gloo" and cpu.is_available()
    assert cpu.on_accelerator(torch.zeros(1))
    cpu.set_device(0)
    cpu.empty_cache()
    with pytest.raises(AcceleratorError, match="device index"):
        cpu.set_device(-1)


def test_cpu_seeding_repeats_draws() -> None:
    cpu = CpuAccelerator()
    cpu.manual_seed_all(7)
    first = torch.rand(3)
    cpu.manual_seed(7)
    assert torch.equal(torch.rand(3), first)


def test_device_accelerator_names_without_a_device() -> None:
    cuda = CudaAccelerator()
    assert cuda.device_name() == "cuda" and cuda.communication_backend_name() == "nccl"
    assert not cuda.on_accelerator(torch.zeros(1))
    assert cuda.is_available() == (torch.cuda.device_count() > 0)
    if torch.cuda.device_count() == 0:
        with pytest.raises(AcceleratorError, match="does not name a visible cuda device"):
            cuda.device_name(0)
        with pytest.raises(AcceleratorError, match="does not name a visible cuda device"):
            cuda.set_device(0)
