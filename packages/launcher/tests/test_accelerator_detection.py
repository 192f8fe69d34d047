"""Finding accelerators without torch: overrides, /dev, /proc, nvidia-smi, CUDA_VISIBLE_DEVICES."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from deepshard.interface.errors import LaunchError
from deepshard.launcher import detect_accelerators


def _fake_root(tmp_path: Path, *, dev: int = 0, proc: int = 0) -> str:
    (tmp_path / "dev").mkdir()
    for i in range(dev):
        (tmp_path / "dev" / f"nvidia{i}").touch()
    # Not GPUs: the control devices every NVIDIA machine has.
    (tmp_path / "dev" / "nvidiactl").touch()
    (tmp_path / "dev" / "nvidia-uvm").touch()
    gpus = tmp_path / "proc" / "driver" / "nvidia" / "gpus"
    gpus.mkdir(parents=True)
    for i in range(proc):
        (gpus / f"0000:0{i}:00.0").mkdir()
    return str(tmp_path)


def _fake_nvidia_smi(bin_dir: Path, gpus: int) -> dict[str, str]:
    bin_dir.mkdir()
    script = bin_dir / "nvidia-smi"
    lines = "".join(f"echo 'GPU {i}: NVIDIA H100 (UUID: GPU-{i:04d})'\n" for i in range(gpus))
    script.write_text(f'#!/bin/sh\n[ "$1" = -L ] || exit 9\n{lines}')
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return {"PATH": f"{bin_dir}{os.pathsep}/usr/bin:/bin"}


def test_no_device_anywhere_is_cpu(tmp_path: Path) -> None:
    found = detect_accelerators({"PATH": str(tmp_path / "nothing")}, root=_fake_root(tmp_path))
    assert (found.kind, found.count, found.variable) == ("cpu", 0, None)


def test_device_files_count_gpus(tmp_path: Path) -> None:
    found = detect_accelerators({}, root=_fake_root(tmp_path, dev=3, proc=8))
    # /dev wins over /proc: a container sees all the host's GPUs in /proc but only its own in /dev.
    assert (found.kind, found.devices, found.variable) == (
        "cuda",
        ("0", "1", "2"),
        "CUDA_VISIBLE_DEVICES",
    )
    assert found.visible_value([0, 2]) == "0,2"


def test_proc_is_used_without_device_files(tmp_path: Path) -> None:
    found = detect_accelerators({}, root=_fake_root(tmp_path, proc=2))
    assert found.devices == ("0", "1") and found.source == "/proc/driver/nvidia/gpus"


def test_nvidia_smi_is_the_last_resort(tmp_path: Path) -> None:
    env = _fake_nvidia_smi(tmp_path / "bin", 2)
    found = detect_accelerators(env, root=_fake_root(tmp_path))
    assert found.devices == ("0", "1") and found.source == "nvidia-smi -L"


def test_cuda_visible_devices_are_the_slots(tmp_path: Path) -> None:
    root = _fake_root(tmp_path, dev=8)
    found = detect_accelerators({"CUDA_VISIBLE_DEVICES": "6,2,GPU-abc"}, root=root)
    assert found.devices == ("6", "2", "GPU-abc")
    # Slot i is the i-th visible device: narrowing keeps the real ids.
    assert found.visible_value([1, 2]) == "2,GPU-abc"
    with pytest.raises(LaunchError, match="slot 3 of worker-0 has no accelerator: the node has 3"):
        found.visible_value([0, 3], "worker-0")
    for hidden in ("", "-1"):
        assert detect_accelerators({"CUDA_VISIBLE_DEVICES": hidden}, root=root).kind == "cpu"


@pytest.mark.parametrize(
    ("env", "kind", "count"),
    [
        ({"DEEPSHARD_ACCELERATOR": "cpu"}, "cpu", 0),
        ({"DS_ACCELERATOR": "CPU"}, "cpu", 0),
        ({"DEEPSHARD_NUM_ACCELERATORS": "0"}, "cpu", 0),
        ({"DEEPSHARD_NUM_ACCELERATORS": "4"}, "cuda", 4),
    ],
)
def test_environment_overrides_detection(
    tmp_path: Path, env: dict[str, str], kind: str, count: int
) -> None:
    found = detect_accelerators(env, root=_fake_root(tmp_path, dev=2))
    assert (found.kind, found.count) == (kind, count)


def test_a_bad_override_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(LaunchError, match="DEEPSHARD_NUM_ACCELERATORS='two'"):
        detect_accelerators({"DEEPSHARD_NUM_ACCELERATORS": "two"}, root=_fake_root(tmp_path))
