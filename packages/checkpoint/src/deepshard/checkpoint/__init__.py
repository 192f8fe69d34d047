"""Sharded checkpoints: safetensors data, JSON metadata, atomic saves, resharding on load.

``save(state, dir, tag=...)`` writes a dict of tensors, each replicated (a plain
``torch.Tensor``) or sharded (a `ShardedTensor`: this rank's storage and its
`deepshard.interface.ShardMap`), collectively over a process group; ``load(dir, like=state)``
fills such a dict in place from a checkpoint saved with any layout and world size, each rank
reading only the bytes it keeps. Nothing is ever unpickled. ``load_state_dict_from_checkpoint``
consolidates a checkpoint in one process, ``save_resharded`` writes whole tensors as an
N-rank checkpoint (offline conversion), and ``verify`` checks checksums and coverage.
"""

from __future__ import annotations

from deepshard.checkpoint._client_state import join_client_state, split_client_state
from deepshard.checkpoint._handle import SaveHandle
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
    "read_metadata",
    "save",
    "save_resharded",
    "split_client_state",
    "verify",
]
