"""The values the checkpoint API takes and returns: sharded tensors, results, save hooks."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol, TypeAlias

import torch

from deepshard.interface import ShardMap
from deepshard.interface.errors import CheckpointError

__all__ = [
    "SAVE_POINTS",
    "JSONValue",
    "LoadResult",
    "SaveHooks",
    "SavePoint",
    "ShardedTensor",
    "StateValue",
    "check_sharded",
    "state_items",
]

JSONValue: TypeAlias = Any
"""A value `json.dumps` accepts (dicts with str keys, lists, str, int, float, bool, None)."""

SavePoint = Literal[
    "before_files", "mid_file", "after_files", "after_metadata", "after_rename", "after_latest"
]
"""The named moments of a save a `SaveHooks` object is told about, in order."""

SAVE_POINTS: tuple[SavePoint, ...] = (
    "before_files",
    "mid_file",
    "after_files",
    "after_metadata",
    "after_rename",
    "after_latest",
)


class SaveHooks(Protocol):
    """Told of each `SavePoint` a save reaches (tests inject crashes here; no global)."""

    def reached(self, point: SavePoint, rank: int) -> None:
        """Called on ``rank`` when the save reaches ``point``."""


@dataclass(frozen=True)
class ShardedTensor:
    """This rank's share of a tensor whose layout a `ShardMap` describes.

    Attributes:
        local: This rank's storage, flat or shaped; its row-major elements are what the map's
            ``local_offset`` counts. ``load`` fills it in place, so it must be contiguous.
        shard_map: Where every rank's pieces sit in the global tensor; its ranks are ranks of
            the group the checkpoint is saved or loaded over.
        rank: This rank's index in that group.
        linear: Whether the values scale with the parameter (parameters, fp32 masters). Pass
            False for optimizer state: loading it through a scaled piece is refused.
    """

    local: torch.Tensor
    shard_map: ShardMap
    rank: int
    linear: bool = True


StateValue: TypeAlias = "torch.Tensor | ShardedTensor"
"""A plain tensor is replicated: identical on every rank, written once by rank 0."""


@dataclass(frozen=True)
class LoadResult:
    """What `load` read.

    Attributes:
        path: The tag directory read.
        metadata: The ``metadata`` mapping the save was given.
        missing: Keys of ``like`` the checkpoint does not hold (left untouched).
        unexpected: Keys the checkpoint holds that ``like`` does not ask for.
        bytes_read: Tensor bytes this rank read from the data files (its share, not the
            whole checkpoint, when the layout is sharded).
    """

    path: Path
    metadata: dict[str, JSONValue]
    missing: tuple[str, ...]
    unexpected: tuple[str, ...]
    bytes_read: int = 0


def check_sharded(name: str, value: ShardedTensor) -> None:
    """Refuse a sharded tensor whose local storage cannot hold its pieces."""
    smap = value.shard_map
    if not isinstance(smap, ShardMap):
        raise CheckpointError(f"{name}: shard_map must be a deepshard.interface.ShardMap")
    if str(value.local.dtype).removeprefix("torch.") != smap.dtype:
        raise CheckpointError(
            f"{name}: local storage is {value.local.dtype} but its shard map says {smap.dtype}; "
            "build the map with the tensor's dtype"
        )
    need = max((p.local_offset + p.numel for p in smap.pieces_of(value.rank)), default=0)
    if value.local.numel() < need:
        raise CheckpointError(
            f"{name}: rank {value.rank}'s local storage has {value.local.numel()} elements but "
            f"its pieces need {need}; pass the whole local shard"
        )


def state_items(state: Mapping[str, Any]) -> list[tuple[str, torch.Tensor | ShardedTensor]]:
    """The state's entries, checked to be tensors or sharded tensors with string keys."""
    items = []
    for name, value in state.items():
        if not isinstance(name, str) or not name:
            raise CheckpointError(f"state key {name!r} must be a non-empty string")
        if isinstance(value, ShardedTensor):
            check_sharded(name, value)
        elif not isinstance(value, torch.Tensor):
            raise CheckpointError(
                f"{name}: a checkpoint holds torch.Tensor or ShardedTensor values, got "
                f"{type(value).__name__}; put other values in metadata (JSON) instead"
            )
        items.append((name, value))
    return items
