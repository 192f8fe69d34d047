"""get_accelerator: explicit names, environment precedence, auto-detection and its errors."""

from __future__ import annotations

import pytest
import torch

from deepshard.accelerators import (
    ACCELERATOR_NAMES,
    AcceleratorError,
    CpuAccelerator,
    CudaAccelerator,
    MpsAccelerator,
    XpuAccelerator,
    get_accelerator,
)
from deepshard.interface.errors import DeepShardError

CLASSES = {
    "cpu": CpuAccelerator,
    "cuda": CudaAccelerator,
    "mps": MpsAccelerator,
    "xpu": XpuAccelerator,
}
DEVICE_CHECKS = {
    "cuda": "torch.cuda.is_available()",
    "mps": "torch.backends.mps.is_available()",
    "xpu": "torch.xpu.is_available()",
}


def test_every_accepted_name_has_a_class():
    assert set(ACCELERATOR_NAMES) == set(CLASSES)


@pytest.mark.parametrize("name", sorted(CLASSES))
def test_explicit_name_selects_its_class_when_the_device_is_usable(name, fake_device):
    fake_device(None if name == "cpu" else name)
    accelerator = get_accelerator(name, env={})
    assert type(accelerator) is CLASSES[name]
    assert accelerator.name == name


@pytest.mark.parametrize("name", sorted(CLASSES))
def test_auto_detection_picks_the_usable_device(name, fake_device):
    fake_device(None if name == "cpu" else name)
    assert type(get_accelerator(env={})) is CLASSES[name]


def test_auto_detection_falls_back_to_cpu_for_a_device_deepshard_does_not_drive(fake_device):
    fake_device("hpu")
    assert type(get_accelerator(env={})) is CpuAccelerator


def test_auto_detection_on_this_machine_matches_torch():
    targeted = torch.accelerator.current_accelerator(check_available=True)
    expected = "cpu" if targeted is None else targeted.type
    assert get_accelerator(env={}).name == expected


def test_cpu_is_always_usable_even_with_a_device_present(fake_device):
    fake_device("cuda", count=4)
    assert type(get_accelerator("cpu", env={})) is CpuAccelerator


def test_deepshard_variable_beats_deepspeed_variable(fake_device):
    fake_device("cuda")
    env = {"DEEPSHARD_ACCELERATOR": "cpu", "DS_ACCELERATOR": "cuda"}
    assert type(get_accelerator(env=env)) is CpuAccelerator
    env = {"DEEPSHARD_ACCELERATOR": "cuda", "DS_ACCELERATOR": "cpu"}
    assert type(get_accelerator(env=env)) is CudaAccelerator


def test_deepspeed_variable_alone_is_honoured(fake_device):
    fake_device("cuda")
    assert type(get_accelerator(env={"DS_ACCELERATOR": "cpu"})) is CpuAccelerator


def test_name_argument_beats_both_variables(fake_device):
    fake_device("cuda")
    env = {"DEEPSHARD_ACCELERATOR": "cuda", "DS_ACCELERATOR": "cuda"}
    assert type(get_accelerator("cpu", env=env)) is CpuAccelerator


def test_empty_variable_counts_as_unset(fake_device):
    fake_device("cuda")
    env = {"DEEPSHARD_ACCELERATOR": "  ", "DS_ACCELERATOR": "cpu"}
    assert type(get_accelerator(env=env)) is CpuAccelerator


def test_names_are_case_and_space_insensitive(fake_device):
    fake_device("cuda")
    assert type(get_accelerator(env={"DEEPSHARD_ACCELERATOR": " CUDA "})) is CudaAccelerator


def test_env_defaults_to_the_process_environment(monkeypatch, fake_device):
    fake_device("cuda")
    monkeypatch.setenv("DEEPSHARD_ACCELERATOR", "cpu")
    assert type(get_accelerator()) is CpuAccelerator


@pytest.mark.parametrize(
    ("name", "env", "source"),
    [
        ("tpu", {}, "the name argument"),
        (None, {"DEEPSHARD_ACCELERATOR": "tpu"}, "DEEPSHARD_ACCELERATOR"),
        (None, {"DS_ACCELERATOR": "tpu"}, "DS_ACCELERATOR"),
    ],
)
def test_unknown_name_names_its_source_and_the_valid_names(name, env, source):
    with pytest.raises(AcceleratorError) as caught:
        get_accelerator(name, env=env)
    message = str(caught.value)
    assert "Unknown accelerator 'tpu'" in message
    assert source in message
    assert "cpu, cuda, mps, xpu" in message
    assert "DEEPSHARD_ACCELERATOR" in message
    assert isinstance(caught.value, DeepShardError)


@pytest.mark.parametrize("name", sorted(DEVICE_CHECKS))
def test_requested_device_that_is_not_available_is_an_error(name, fake_device):
    fake_device(None)
    with pytest.raises(AcceleratorError, match=r"not usable") as caught:
        get_accelerator(env={"DEEPSHARD_ACCELERATOR": name})
    assert DEVICE_CHECKS[name] in str(caught.value)
    assert "DEEPSHARD_ACCELERATOR" in str(caught.value)


def test_device_available_but_not_torch_accelerator_target_is_an_error(fake_device, monkeypatch):
    fake_device("xpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(AcceleratorError, match=r"current_accelerator\(\) is xpu, not cuda"):
        get_accelerator("cuda", env={})


def test_xpu_requested_on_a_torch_without_xpu_module(fake_device, monkeypatch):
    fake_device("xpu")
    monkeypatch.delattr(torch, "xpu")
    with pytest.raises(AcceleratorError, match=r"has no torch\.xpu module"):
        get_accelerator("xpu", env={})


@pytest.mark.parametrize("old", ["2.4.1", "2.4.0a0+git1234", "1.13.1+cpu"])
def test_mps_needs_torch_2_5(old, fake_device, monkeypatch):
    fake_device("mps")
    monkeypatch.setattr(torch, "__version__", old)
    with pytest.raises(AcceleratorError, match=r"MPS needs torch >= 2\.5") as caught:
        get_accelerator("mps", env={})
    assert old in str(caught.value)


@pytest.mark.parametrize("new", ["2.5.0", "2.10.1+cpu", "3.0.0"])
def test_mps_accepts_torch_2_5_and_newer(new, fake_device, monkeypatch):
    fake_device("mps")
    monkeypatch.setattr(torch, "__version__", new)
    assert type(get_accelerator("mps", env={})) is MpsAccelerator


def test_auto_detected_mps_on_old_torch_is_an_error_not_a_silent_cpu(fake_device, monkeypatch):
    fake_device("mps")
    monkeypatch.setattr(torch, "__version__", "2.4.1")
    with pytest.raises(AcceleratorError, match=r"from auto-detection"):
        get_accelerator(env={})


def test_instances_of_one_kind_are_interchangeable(fake_device):
    fake_device("cuda")
    assert get_accelerator("cuda", env={}) == CudaAccelerator()
    assert get_accelerator("cpu", env={}) != CudaAccelerator()
    assert len({CpuAccelerator(), CpuAccelerator()}) == 1
