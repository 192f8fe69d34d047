"""``save_resharded``: write, from one process, the checkpoint a world of N ranks would write.

Offline conversion (``ds-checkpoint reshard``, importing another framework's checkpoint) has
whole tensors and wants a checkpoint laid out for N ranks. Each rank's local storage is cut
from the whole tensor with the same copies a load would make (a whole-tensor map read into
the target map's pieces of that rank); then each rank's part is written exactly as that rank
would write it during a save, and the metadata and ``latest`` are published as rank 0 does.
Loading needs none of this (it reshards any checkpoint); it only makes the files match a
layout, e.g. so that each rank of the new world reads one file.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path

import torch

from deepshard.checkpoint._exchange import Members
from deepshard.checkpoint._layout import TMP_PREFIX, check_tag
from deepshard.checkpoint._plan import plan_rank
from deepshard.checkpoint._reshard import apply_copies, plan_copies
from deepshard.checkpoint._save import _check_metadata, _Job, _publish_tag, _write_part
from deepshard.checkpoint._types import JSONValue, ShardedTensor
from deepshard.interface import ShardMap, ShardPiece
from deepshard.interface.errors import CheckpointError

__all__ = ["save_resharded"]


def _local_of(name: str, full: torch.Tensor, smap: ShardMap, rank: int) -> torch.Tensor:
    shape = tuple(full.shape)
    whole = ShardMap(shape, smap.dtype, (ShardPiece(0, tuple(0 for _ in shape), shape),))
    size = max((p.local_offset + p.numel for p in smap.pieces_of(rank)), default=0)
    local = torch.zeros(size, dtype=full.dtype)
    flat = full.detach().reshape(-1)
    copies = plan_copies(name, whole, smap, rank, linear=True)
    apply_copies(local, copies, lambda _rank, start, stop: flat[start:stop])
    return local


def save_resharded(
    state: Mapping[str, torch.Tensor],
    maps: Mapping[str, ShardMap],
    save_dir: str | os.PathLike[str],
    *,
    tag: str,
    world_size: int,
    metadata: Mapping[str, JSONValue] | None = None,
    save_latest: bool = True,
) -> Path:
    """Write whole tensors as a ``world_size``-rank checkpoint laid out by ``maps``.

    Args:
        state: Whole tensors; those without an entry in ``maps`` are saved replicated.
        maps: The layout of the sharded tensors (ranks ``0 .. world_size - 1``).
        save_dir: The checkpoint directory.
        tag: The new tag.
        world_size: The number of rank files to write.
        metadata: JSON-serialisable values for ``metadata.json``.
        save_latest: Point ``latest`` at the new tag.

    Returns:
        The new tag directory.
    """
    tag = check_tag(tag)
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise CheckpointError(f"world_size must be an int >= 1, got {world_size!r}")
    unknown = sorted(set(maps) - set(state))
    if unknown:
        raise CheckpointError(f"maps name tensors the state lacks: {unknown[:8]}")
    document = _check_metadata(metadata)
    root = Path(save_dir)
    root.mkdir(parents=True, exist_ok=True)
    tmp_dir = root / f"{TMP_PREFIX}{tag}-{uuid.uuid4().hex[:12]}"
    tmp_dir.mkdir()
    jobs = []
    for rank in range(world_size):
        items: list[tuple[str, torch.Tensor | ShardedTensor]] = []
        for name, tensor in state.items():
            smap = maps.get(name)
            if smap is None:
                items.append((name, tensor))
            else:
                items.append((name, ShardedTensor(_local_of(name, tensor, smap, rank), smap, rank)))
        plan = plan_rank(items, rank)
        members = Members(None, rank, world_size)
        jobs.append(_Job(members, root, tmp_dir, tag, plan, document, save_latest, None, None, 1.0))
        _write_part(jobs[-1])
    return _publish_tag(replace(jobs[0], timeout_s=0.0))
