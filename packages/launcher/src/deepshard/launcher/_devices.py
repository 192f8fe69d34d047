"""Finding a node's accelerators without importing torch.

``ds-launch`` must start instantly, so it asks the operating system instead of torch. First
match wins:

1. ``DEEPSHARD_ACCELERATOR`` (or DeepSpeed's ``DS_ACCELERATOR``) is ``cpu``: no accelerator.
2. ``DEEPSHARD_NUM_ACCELERATORS=N``: N devices, ``0..N-1`` (``0`` means CPU only). This is the
   override for machines where detection is wrong, and for tests.
3. NVIDIA devices: the ``/dev/nvidia<N>`` device files (in a container only the GPUs it was
   given have one), else the entries of ``/proc/driver/nvidia/gpus``, else the lines of
   ``nvidia-smi -L`` (WSL exposes no device files).
4. Nothing found: the node runs CPU ranks.

When ``CUDA_VISIBLE_DEVICES`` is set on a node with GPUs, it decides which devices the node
offers: its entries (indices, UUIDs or MIG ids alike) are the node's devices, in order. A *slot*
is an index into this list, so slot ``i`` is what the rank would see as ``cuda:i`` before
narrowing, and each rank of the node gets ``CUDA_VISIBLE_DEVICES`` narrowed to the node's slots.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import subprocess
from collections.abc import Mapping

from deepshard.interface.errors import LaunchError

__all__ = ["NUM_ACCELERATORS_ENV", "Accelerators", "detect_accelerators"]

NUM_ACCELERATORS_ENV = "DEEPSHARD_NUM_ACCELERATORS"
"""Overrides detection with a device count (``0``: CPU only)."""
_SELECTION_ENV = ("DEEPSHARD_ACCELERATOR", "DS_ACCELERATOR")
_CUDA_VISIBLE = "CUDA_VISIBLE_DEVICES"
_NVIDIA_SMI_TIMEOUT_S = 10


@dataclasses.dataclass(frozen=True)
class Accelerators:
    """The accelerators a node offers its ranks.

    Attributes:
        kind: ``"cuda"``, or ``"cpu"`` when there are none.
        devices: How each device is named in ``variable`` (``"0"``, ``"GPU-…"``), in slot order.
        variable: The environment variable that narrows visibility, ``None`` on CPU.
        source: How they were found, for ``--dry_run`` and error messages.
    """

    kind: str
    devices: tuple[str, ...]
    variable: str | None
    source: str

    @property
    def count(self) -> int:
        """Number of devices (slots) the node offers; 0 on CPU."""
        return len(self.devices)

    def visible_value(self, slots: list[int] | tuple[int, ...], host: str = "this node") -> str:
        """The value of `variable` that exposes exactly ``slots``, in that order.

        Raises:
            LaunchError: A slot has no device (the hostfile promises more than the node has).
        """
        missing = [slot for slot in slots if slot >= self.count]
        if missing:
            raise LaunchError(
                f"slot {missing[0]} of {host} has no accelerator: the node has {self.count} "
                f"({self.source}); lower its slots in the hostfile or fix the filter"
            )
        return ",".join(self.devices[slot] for slot in slots)


CPU_ONLY = Accelerators("cpu", (), None, "no accelerator found")


def _nvidia_device_files(root: str) -> int:
    try:
        names = os.listdir(os.path.join(root, "dev"))
    except OSError:
        return 0
    return sum(1 for name in names if re.fullmatch(r"nvidia\d+", name))


def _proc_gpus(root: str) -> int:
    try:
        return len(os.listdir(os.path.join(root, "proc", "driver", "nvidia", "gpus")))
    except OSError:
        return 0


def _nvidia_smi(env: Mapping[str, str]) -> int:
    program = shutil.which("nvidia-smi", path=env.get("PATH", os.defpath))
    if program is None:
        return 0
    try:
        listing = subprocess.run(
            [program, "-L"],
            capture_output=True,
            text=True,
            timeout=_NVIDIA_SMI_TIMEOUT_S,
            check=False,
            env=dict(env),
        )
    except (OSError, subprocess.TimeoutExpired):
        return 0
    if listing.returncode != 0:
        return 0
    return sum(1 for line in listing.stdout.splitlines() if line.startswith("GPU "))


def _override(env: Mapping[str, str]) -> Accelerators | None:
    if any(env.get(name, "").strip().lower() == "cpu" for name in _SELECTION_ENV):
        return dataclasses.replace(CPU_ONLY, source="DEEPSHARD_ACCELERATOR/DS_ACCELERATOR=cpu")
    raw = env.get(NUM_ACCELERATORS_ENV)
    if raw is None:
        return None
    if not raw.strip().isdigit():
        raise LaunchError(
            f"{NUM_ACCELERATORS_ENV}={raw!r} is not a device count; set a non-negative integer "
            "(0 for CPU only) or unset it to detect accelerators"
        )
    count = int(raw)
    if count == 0:
        return dataclasses.replace(CPU_ONLY, source=f"{NUM_ACCELERATORS_ENV}=0")
    devices = tuple(str(i) for i in range(count))
    return Accelerators("cuda", devices, _CUDA_VISIBLE, f"{NUM_ACCELERATORS_ENV}={count}")


def _narrowed(found: Accelerators, env: Mapping[str, str]) -> Accelerators:
    visible = env.get(_CUDA_VISIBLE)
    if visible is None:
        return found
    devices = tuple(item.strip() for item in visible.split(",") if item.strip())
    if not devices or devices[0] in ("-1", "none", "NoDevFiles"):
        return dataclasses.replace(CPU_ONLY, source=f"{_CUDA_VISIBLE}={visible!r}")
    return Accelerators("cuda", devices, _CUDA_VISIBLE, f"{_CUDA_VISIBLE}={visible}")


def detect_accelerators(env: Mapping[str, str], *, root: str = "/") -> Accelerators:
    """The accelerators of this node (see the module docstring for the order of checks).

    Args:
        env: The environment to read (``os.environ`` in the launcher).
        root: File-system root to look for ``/dev`` and ``/proc`` under (tests pass a fake one).

    Returns:
        What the node offers; `CPU_ONLY`-like when nothing is found.

    Raises:
        LaunchError: ``DEEPSHARD_NUM_ACCELERATORS`` is not a non-negative integer.
    """
    override = _override(env)
    if override is not None:
        return override
    count, source = _nvidia_device_files(root), "/dev/nvidia*"
    if not count:
        count, source = _proc_gpus(root), "/proc/driver/nvidia/gpus"
    if not count:
        count, source = _nvidia_smi(env), "nvidia-smi -L"
    if not count:
        return CPU_ONLY
    found = Accelerators("cuda", tuple(str(i) for i in range(count)), _CUDA_VISIBLE, source)
    return _narrowed(found, env)
