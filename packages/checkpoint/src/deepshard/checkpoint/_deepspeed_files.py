"""Opening DeepSpeed's pickled ``.pt`` files without running any code they carry.

DeepSpeed writes its checkpoints with ``torch.save``: a pickle, which may name any callable and
have it called on load. DeepShard reads them only with ``torch.load(weights_only=True)``, whose
unpickler builds tensors, containers and primitives and refuses every other global. DeepSpeed
0.19.7's ZeRO files name exactly three globals of its own, none of which needs DeepSpeed's code
to be read:

* ``deepspeed.runtime.zero.config.ZeroStageEnum`` (an ``IntEnum``, pickled as a call with the
  stage number): read as a plain ``int``;
* ``deepspeed.utils.tensor_fragment.fragment_address`` (a dataclass ``(numel, start)`` rebuilt
  from its ``__dict__``): read as `FragmentAddress`, which keeps the two integers;
* ``deepspeed.runtime.fp16.loss_scaler.LossScaler`` / ``DynamicLossScaler`` (objects rebuilt
  from their ``__dict__``): read as `LossScalerRecord`, which only stores that dict.

They are allowed by exact name, for the duration of one ``torch.load`` (torch's scoped
``safe_globals``), and map to these inert stand-ins, so DeepSpeed need not be installed.
Anything else a file names is refused with a `CheckpointError` that says which global and why.
"""

from __future__ import annotations

import os
import pickle
import re
from pathlib import Path
from typing import Any

import torch

from deepshard.interface.errors import CheckpointError

__all__ = ["SAFE_DEEPSPEED_GLOBALS", "FragmentAddress", "LossScalerRecord", "load_deepspeed_file"]


class FragmentAddress:
    """Stand-in for DeepSpeed's ``fragment_address``: where a parameter sits in a partition.

    Attributes:
        numel: How many of the parameter's elements the partition holds.
        start: Offset of the first of them in the rank's flat fp32 partition.
    """

    def __init__(self, numel: int = 0, start: int = 0) -> None:
        self.numel = numel
        self.start = start

    def __setstate__(self, state: dict[str, Any]) -> None:
        # Only the two integers are kept, whatever else the dict holds.
        self.numel = _int_field(state, "numel")
        self.start = _int_field(state, "start")

    def __repr__(self) -> str:
        return f"FragmentAddress(numel={self.numel}, start={self.start})"


def _int_field(state: dict[str, Any], key: str) -> int:
    value = state.get(key) if isinstance(state, dict) else None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise CheckpointError(f"a DeepSpeed fragment_address has {key}={value!r}, not an int >= 0")
    return value


class LossScalerRecord:
    """Stand-in for DeepSpeed's loss scalers: their attributes, nothing callable."""

    def __init__(self) -> None:
        self.state: dict[str, Any] = {}

    def __setstate__(self, state: dict[str, Any]) -> None:
        # The unpickler hands the original object's __dict__; keep it as data.
        self.state = dict(state)


SAFE_DEEPSPEED_GLOBALS: tuple[tuple[Any, str], ...] = (
    (int, "deepspeed.runtime.zero.config.ZeroStageEnum"),
    (FragmentAddress, "deepspeed.utils.tensor_fragment.fragment_address"),
    (LossScalerRecord, "deepspeed.runtime.fp16.loss_scaler.LossScaler"),
    (LossScalerRecord, "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler"),
)
"""The DeepSpeed globals allowed in a file, by exact name, and what each is read as."""


def _unpickler_reason(message: str) -> str:
    """torch's own sentence naming the refused global, without its advice to unpickle anyway."""
    match = re.search(r"WeightsUnpickler error: ([^\n]*)", message)
    if match:
        return match[1].strip().rstrip(".")
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    return lines[-1] if lines else "the unpickler refused it"


def load_deepspeed_file(path: str | os.PathLike[str]) -> Any:
    """Read one DeepSpeed ``.pt`` file with ``torch.load(weights_only=True)`` on CPU.

    Raises:
        CheckpointError: The file is missing or damaged, or it needs arbitrary unpickling (it
            names a global that is neither torch's safe set nor `SAFE_DEEPSPEED_GLOBALS`).
    """
    file = Path(path)
    try:
        with torch.serialization.safe_globals(list(SAFE_DEEPSPEED_GLOBALS)):
            return torch.load(file, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        reason = _unpickler_reason(str(exc))
        raise CheckpointError(
            f"{file}: refused, reading it would need arbitrary unpickling ({reason}). "
            "DeepShard never runs code from a checkpoint; load it with DeepSpeed in a trusted "
            "environment and re-save tensors only (e.g. zero_to_fp32 to safetensors)"
        ) from exc
    except FileNotFoundError as exc:
        raise CheckpointError(f"{file}: no such DeepSpeed checkpoint file") from exc
    except (RuntimeError, OSError, EOFError, ValueError) as exc:
        raise CheckpointError(f"{file}: not a readable torch.save file ({exc})") from exc
