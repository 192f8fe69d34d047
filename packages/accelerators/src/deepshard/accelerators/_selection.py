"""Choosing the accelerator: an explicit name, then the environment, then auto-detection.

Precedence, first match wins:

1. the ``name`` argument of `get_accelerator`;
2. ``DEEPSHARD_ACCELERATOR``;
3. ``DS_ACCELERATOR`` (the variable DeepSpeed users already set);
4. auto-detection: the accelerator this torch build targets
   (``torch.accelerator.current_accelerator(check_available=True)``), if DeepShard drives it and
   it is usable, else the CPU. A torch build targets at most one accelerator, so there is no
   ranking between cuda, xpu and mps to make.

A name that was asked for (argument or environment) must be usable: an unknown name or an
unusable device raises `AcceleratorError` instead of silently falling back to the CPU.

Nothing is cached: accelerators are stateless, each call re-reads the environment, and instances
of one kind compare equal.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping

import torch

from deepshard.accelerators._cpu import CpuAccelerator
from deepshard.accelerators._device import CudaAccelerator, MpsAccelerator, XpuAccelerator
from deepshard.accelerators._errors import AcceleratorError
from deepshard.interface.accelerator import Accelerator

__all__ = ["ACCELERATOR_NAMES", "ENV_VARS", "get_accelerator"]

ENV_VARS = ("DEEPSHARD_ACCELERATOR", "DS_ACCELERATOR")
"""Environment variables that name the accelerator, highest precedence first."""

_CLASSES: dict[str, Callable[[], Accelerator]] = {
    "cpu": CpuAccelerator,
    "cuda": CudaAccelerator,
    "mps": MpsAccelerator,
    "xpu": XpuAccelerator,
}
ACCELERATOR_NAMES = tuple(sorted(_CLASSES))
"""Every name `get_accelerator` accepts."""

_MPS_MIN_TORCH = (2, 5)


def _torch_version() -> tuple[int, int] | None:
    """``(major, minor)`` of the running torch, or ``None`` if its version string is unreadable."""
    match = re.match(r"(\d+)\.(\d+)", str(torch.__version__))
    return None if match is None else (int(match[1]), int(match[2]))


def _cuda_problem() -> str | None:
    if not torch.cuda.is_available():
        return (
            "torch.cuda.is_available() is False (no CUDA or ROCm device or driver is visible; "
            "check nvidia-smi and CUDA_VISIBLE_DEVICES, and that torch is a CUDA build)"
        )
    return None


def _mps_problem() -> str | None:
    version = _torch_version()
    if version is None or version < _MPS_MIN_TORCH:
        return f"MPS needs torch >= 2.5 but torch is {torch.__version__}; upgrade torch"
    if not torch.backends.mps.is_available():
        return (
            "torch.backends.mps.is_available() is False (MPS needs Apple silicon, macOS 12.3 or "
            "newer, and a torch build with MPS)"
        )
    return None


def _xpu_problem() -> str | None:
    xpu = getattr(torch, "xpu", None)
    if xpu is None:
        return f"torch {torch.__version__} has no torch.xpu module"
    if not xpu.is_available():
        return (
            "torch.xpu.is_available() is False (no Intel GPU or driver is visible, or torch is "
            "not an XPU build)"
        )
    return None


_DEVICE_PROBLEMS: dict[str, Callable[[], str | None]] = {
    "cuda": _cuda_problem,
    "mps": _mps_problem,
    "xpu": _xpu_problem,
}


def _problem(name: str) -> str | None:
    """Why accelerator ``name`` cannot be used in this process, or ``None`` if it can."""
    if name == "cpu":
        return None
    if not hasattr(torch, "accelerator"):
        return f"torch {torch.__version__} has no torch.accelerator; upgrade torch to 2.6 or newer"
    problem = _DEVICE_PROBLEMS[name]()
    if problem is not None:
        return problem
    targeted = torch.accelerator.current_accelerator()
    if targeted is None or targeted.type != name:
        return (
            f"torch.accelerator.current_accelerator() is {targeted}, not {name}, so torch's "
            "device-generic API would address another device"
        )
    return None


def _requested(name: str | None, env: Mapping[str, str]) -> tuple[str, str] | None:
    """The requested name (normalised) and where it came from, or ``None`` to auto-detect."""
    if name is not None:
        return name.strip().lower(), "the name argument"
    for var in ENV_VARS:
        value = env.get(var, "").strip()
        if value:
            return value.lower(), var
    return None


def _detect() -> str:
    """The accelerator torch targets and can use right now, if DeepShard drives it; else cpu."""
    if not hasattr(torch, "accelerator"):
        return "cpu"
    targeted = torch.accelerator.current_accelerator(check_available=True)
    if targeted is None or targeted.type not in _CLASSES:
        return "cpu"
    return targeted.type


def get_accelerator(
    name: str | None = None, *, env: Mapping[str, str] | None = None
) -> Accelerator:
    """Return the accelerator to run on.

    Args:
        name: ``"cpu"``, ``"cuda"``, ``"mps"`` or ``"xpu"`` (case-insensitive); ``None`` defers to
            ``DEEPSHARD_ACCELERATOR``, then ``DS_ACCELERATOR``, then auto-detection.
        env: The environment to read those variables from; ``os.environ`` when ``None``.

    Returns:
        A stateless object satisfying `deepshard.interface.accelerator.Accelerator`.

    Raises:
        AcceleratorError: The requested name is unknown, or that device is not usable here
            (also when auto-detection picks a device this torch cannot drive, e.g. MPS on an old
            torch).
    """
    request = _requested(name, os.environ if env is None else env)
    valid = ", ".join(ACCELERATOR_NAMES)
    how_to_fix = (
        f"Choose one of {valid}, or unset DEEPSHARD_ACCELERATOR and DS_ACCELERATOR and pass no "
        "name to auto-detect."
    )
    if request is None:
        chosen, source = _detect(), "auto-detection"
    else:
        chosen, source = request
        if chosen not in _CLASSES:
            raise AcceleratorError(f"Unknown accelerator {chosen!r} (from {source}). {how_to_fix}")
    problem = _problem(chosen)
    if problem is not None:
        raise AcceleratorError(
            f"Accelerator {chosen!r} (from {source}) is not usable: {problem}. {how_to_fix}"
        )
    return _CLASSES[chosen]()
