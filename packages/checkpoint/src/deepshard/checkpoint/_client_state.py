"""Splitting a caller's ``client_state`` into JSON for the metadata and tensors for safetensors.

The engine's ``save_checkpoint(client_state=...)`` takes any nesting of dicts, lists and
tuples. Scalars and strings stay in the JSON metadata; each tensor moves to the state saved in
the safetensors files under its key path (``client_state/optimizer/0``) and leaves a marker
``{"__tensor__": key}`` in its place; anything else is refused, naming where it sits, because
storing it would need a pickle. Tuples come back as lists (JSON has no tuples).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from deepshard.interface.errors import CheckpointError

__all__ = ["TENSOR_MARKER", "join_client_state", "split_client_state"]

TENSOR_MARKER = "__tensor__"


def _split(value: Any, path: str, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(value, torch.Tensor):
        tensors[path] = value.detach()
        return {TENSOR_MARKER: path}
    if isinstance(value, Mapping):
        out = {}
        for key, item in value.items():
            if not isinstance(key, str) or key == TENSOR_MARKER or "/" in key:
                raise CheckpointError(
                    f"{path}: key {key!r} cannot be stored; client_state keys must be strings "
                    f"without '/' and not {TENSOR_MARKER!r}"
                )
            out[key] = _split(item, f"{path}/{key}", tensors)
        return out
    if isinstance(value, (list, tuple)):
        return [_split(item, f"{path}/{i}", tensors) for i, item in enumerate(value)]
    if isinstance(value, float) and not math.isfinite(value):
        raise CheckpointError(
            f"{path}: {value} is not valid JSON; store it as a tensor or a string"
        )
    if value is None or isinstance(value, (str, bool, int, float)):
        return value
    raise CheckpointError(
        f"{path}: a {type(value).__name__} is neither JSON-serialisable nor a tensor, and "
        "checkpoints never pickle; store its state as numbers, strings, lists, dicts or tensors"
    )


def split_client_state(
    client_state: Mapping[str, Any], *, prefix: str = "client_state"
) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """``(json_part, tensors)``: put ``json_part`` in the save's metadata, ``tensors`` in its state.

    Raises:
        CheckpointError: A value that is neither JSON nor a tensor, named by its key path.
    """
    tensors: dict[str, torch.Tensor] = {}
    if not isinstance(client_state, Mapping):
        raise CheckpointError(f"{prefix} must be a dict, got {type(client_state).__name__}")
    json_part = _split(client_state, prefix, tensors)
    return json_part, tensors


def _join(value: Any, tensors: Mapping[str, torch.Tensor]) -> Any:
    if isinstance(value, dict):
        if set(value) == {TENSOR_MARKER}:
            key = value[TENSOR_MARKER]
            if key not in tensors:
                raise CheckpointError(f"client_state tensor {key!r} is not in the checkpoint")
            return tensors[key]
        return {k: _join(v, tensors) for k, v in value.items()}
    if isinstance(value, list):
        return [_join(item, tensors) for item in value]
    return value


def join_client_state(json_part: Any, tensors: Mapping[str, torch.Tensor]) -> Any:
    """Undo `split_client_state`: the markers in ``json_part`` replaced by their tensors."""
    return _join(json_part, tensors)
