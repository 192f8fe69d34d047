"""Every random-number stream a training step may draw from, as fixed-size tensors per rank.

Exact resume needs the streams where they were: Python's `random` (data augmentation), NumPy's
legacy global generator (when NumPy is importable), torch's CPU generator (dropout on CPU,
``randperm``) and the accelerator's default generator. Each rank has its own streams, so each
is saved as one row per rank of a ``(world, n)`` tensor: rank ``r`` holds row ``r``, and a run of
the same world size gets its own row back. Fixed sizes make that possible: Python's Mersenne
Twister state is a version, 625 words and an optional cached Gaussian, NumPy's 624 words, a
position and a cached Gaussian; the words (below 2^32) are exact in float64. Nothing here
pickles.
"""

from __future__ import annotations

import importlib
import random
from typing import Any

import torch

from deepshard.interface import ShardMap, ShardPiece
from deepshard.interface.errors import CheckpointError

__all__ = ["RNG_PREFIX", "capture_rng", "restore_rng", "rng_map"]

RNG_PREFIX = "rng/"
"""Key prefix of the RNG rows in a checkpoint (``rng/python``, ``rng/torch_cpu`` ...)."""

_PY_WORDS = 625


def _numpy() -> Any:
    try:
        return importlib.import_module("numpy")
    except ImportError:
        return None


def _python_state() -> torch.Tensor:
    version, words, gauss = random.getstate()
    values = [float(version), *map(float, words), float(gauss is not None), gauss or 0.0]
    return torch.tensor(values, dtype=torch.float64)


def _set_python_state(row: torch.Tensor) -> None:
    values = row.tolist()
    words = tuple(int(v) for v in values[1 : 1 + _PY_WORDS])
    gauss = values[-1] if values[-2] else None
    random.setstate((int(values[0]), words, gauss))


def _numpy_state(np: Any) -> torch.Tensor:
    _, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    values = [*map(float, keys.tolist()), float(pos), float(has_gauss), float(cached)]
    return torch.tensor(values, dtype=torch.float64)


def _set_numpy_state(np: Any, row: torch.Tensor) -> None:
    values = row.tolist()
    keys = np.array([int(v) for v in values[:-3]], dtype=np.uint32)
    np.random.set_state(("MT19937", keys, int(values[-3]), int(values[-2]), values[-1]))


def _device_module(device_type: str) -> Any:
    module = getattr(torch, device_type, None)
    return module if module is not None and hasattr(module, "get_rng_state") else None


def capture_rng(device_type: str) -> dict[str, torch.Tensor]:
    """This rank's streams by name (``python``, ``numpy``, ``torch_cpu``, ``torch_<device>``)."""
    streams = {"python": _python_state(), "torch_cpu": torch.get_rng_state()}
    np = _numpy()
    if np is not None:
        streams["numpy"] = _numpy_state(np)
    module = _device_module(device_type) if device_type != "cpu" else None
    if module is not None:
        streams[f"torch_{device_type}"] = module.get_rng_state().cpu()
    return streams


def restore_rng(streams: dict[str, torch.Tensor], device_type: str) -> None:
    """Put the streams `capture_rng` returned (this rank's rows) back.

    Raises:
        CheckpointError: A stream of another accelerator than this run's.
    """
    for name, row in streams.items():
        if name == "python":
            _set_python_state(row)
        elif name == "numpy":
            np = _numpy()
            if np is not None:  # saved where NumPy was importable; nothing to restore here
                _set_numpy_state(np, row)
        elif name == "torch_cpu":
            torch.set_rng_state(row.to(torch.uint8))
        elif name == f"torch_{device_type}" and _device_module(device_type) is not None:
            _device_module(device_type).set_rng_state(row.to(torch.uint8))
        else:
            raise CheckpointError(
                f"the checkpoint holds the RNG state {name!r}, which a {device_type} run has no "
                "generator for; load it on the accelerator it was saved on, or load with "
                "load_module_only=True"
            )


def rng_map(row: torch.Tensor, world_size: int) -> ShardMap:
    """The map of a ``(world_size, n)`` tensor whose row ``r`` rank ``r`` holds."""
    n = row.numel()
    dtype = str(row.dtype).removeprefix("torch.")
    pieces = tuple(ShardPiece(r, (r, 0), (1, n)) for r in range(world_size))
    return ShardMap((world_size, n), dtype, pieces)
