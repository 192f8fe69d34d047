"""Sharded checkpoints: safetensors data, JSON metadata, atomic saves, resharding on load.

``save(state, dir, tag=...)`` writes a dict of tensors, each replicated (a plain
``torch.Tensor``) or sharded (a `ShardedTensor`: this rank's storage and its
`deepshard.interface.ShardMap`), collectively over a process group; ``load(dir, like=state)``
fills such a dict in place from a checkpoint saved with any layout and world size, each rank
reading only the bytes it keeps. Nothing is ever unpickled. ``load_state_dict_from_checkpoint``
consolidates a checkpoint in one process; ``verify`` checks its checksums and coverage;
``prepare_async_save`` readies a first background save's host buffers ahead of time.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from deepshard.checkpoint._client_state import join_client_state, split_client_state
    from deepshard.checkpoint._handle import SaveHandle
    from deepshard.checkpoint._host_buffers import prepare_async_save
    from deepshard.checkpoint._layout import list_tags, read_metadata
    from deepshard.checkpoint._load import load, load_state_dict_from_checkpoint
    from deepshard.checkpoint._offline import save_resharded
    from deepshard.checkpoint._save import save
    from deepshard.checkpoint._types import (
        SAVE_POINTS,
        LoadResult,
        SaveHooks,
        SavePoint,
        ShardedTensor,
    )
    from deepshard.checkpoint._verify import VerifyReport, verify

# Public name -> the private module that defines it. Imported on first use (PEP 562), so that
# `ds-checkpoint --help` (deepshard.checkpoint.cli) starts without importing torch.
_HOMES = {
    "SAVE_POINTS": "_types",
    "LoadResult": "_types",
    "SaveHandle": "_handle",
    "SaveHooks": "_types",
    "SavePoint": "_types",
    "ShardedTensor": "_types",
    "VerifyReport": "_verify",
    "join_client_state": "_client_state",
    "list_tags": "_layout",
    "load": "_load",
    "load_state_dict_from_checkpoint": "_load",
    "prepare_async_save": "_host_buffers",
    "read_metadata": "_layout",
    "save": "_save",
    "save_resharded": "_offline",
    "split_client_state": "_client_state",
    "verify": "_verify",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{home}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)


__all__ = [
    "SAVE_POINTS",
    "LoadResult",
    "SaveHandle",
    "SaveHooks",
    "SavePoint",
    "ShardedTensor",
    "VerifyReport",
    "join_client_state",
    "list_tags",
    "load",
    "load_state_dict_from_checkpoint",
    "prepare_async_save",
    "read_metadata",
    "save",
    "save_resharded",
    "split_client_state",
    "verify",
]
