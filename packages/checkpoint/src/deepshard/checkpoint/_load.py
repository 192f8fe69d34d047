"""``load`` into live shards (resharding on the fly) and consolidated loading in one process.

A load first checks the files: every rank checks the size of each file it will open, and the
ranks share the SHA-256 checks (file ``i`` by rank ``i % W``), so each file is hashed once per
load; then the ranks agree that all checks passed before anything is written into the caller's
tensors. Filling is `_reshard`'s copies, read with ``safe_open(...).get_slice``, which maps the
file and reads only the requested range. A final exchange makes an error on one rank an error
on all of them.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from deepshard.checkpoint._exchange import Members, all_gather_json, members_of
from deepshard.checkpoint._layout import read_metadata, resolve_tag_dir, tag_dir_of
from deepshard.checkpoint._reshard import apply_copies, plan_copies
from deepshard.checkpoint._safetensors_io import sha256_of
from deepshard.checkpoint._save import SaveHandle
from deepshard.checkpoint._types import LoadResult, ShardedTensor, StateValue, state_items
from deepshard.comm import Group
from deepshard.interface import ShardMap, ShardPiece
from deepshard.interface.errors import CheckpointError

__all__ = ["load", "load_state_dict_from_checkpoint", "torch_dtype"]


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype a shard map names (``"bfloat16"``)."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"unknown dtype {name!r} in checkpoint metadata")
    return dtype


def check_file(path: Path, expected: Mapping[str, Any], *, checksum: bool) -> None:
    """Raise `CheckpointError` naming ``path`` if it is missing, truncated or tampered with."""
    try:
        size = path.stat().st_size
    except FileNotFoundError as exc:
        raise CheckpointError(f"{path} is missing; the checkpoint is incomplete") from exc
    if size != expected["size"]:
        raise CheckpointError(
            f"{path} has {size} bytes, the metadata says {expected['size']}: it is truncated "
            "or was replaced; restore it or load another tag"
        )
    if checksum and sha256_of(path).sha256 != expected["sha256"]:
        raise CheckpointError(
            f"{path} does not match its SHA-256 in the metadata: it is corrupt or was modified; "
            "restore it or load another tag"
        )


class _Reader:
    """Opens each data file once and reads flat ranges of its entries."""

    def __init__(self, tag_dir: Path, stack: contextlib.ExitStack) -> None:
        self.tag_dir = tag_dir
        self.stack = stack
        self.handles: dict[str, Any] = {}

    def reader(self, name: str, files: Mapping[str, str]) -> Any:
        def read(rank: int, start: int, stop: int) -> torch.Tensor:
            file = files.get(str(rank))
            if file is None:
                raise CheckpointError(f"{name}: the metadata names no file for rank {rank}'s shard")
            try:
                if file not in self.handles:
                    opened = safe_open(self.tag_dir / file, framework="pt")
                    self.handles[file] = self.stack.enter_context(opened)
                data: torch.Tensor = self.handles[file].get_slice(name)[start:stop]
                return data
            except (SafetensorError, OSError) as exc:
                raise CheckpointError(
                    f"{self.tag_dir / file}: cannot read {name!r} ({exc}); the file is damaged"
                ) from exc

        return read


def _target(name: str, value: StateValue, rank: int) -> tuple[torch.Tensor, ShardMap, int, bool]:
    local = value.local if isinstance(value, ShardedTensor) else value
    if not local.is_contiguous():
        raise CheckpointError(
            f"{name}: load fills tensors in place, and this one is not contiguous; pass a "
            "contiguous view of the live storage"
        )
    if isinstance(value, ShardedTensor):
        return local.view(-1), value.shard_map, value.rank, value.linear
    shape = tuple(local.shape)
    dtype = str(local.dtype).removeprefix("torch.")
    whole = ShardMap(shape, dtype, (ShardPiece(rank, tuple(0 for _ in shape), shape),))
    return local.view(-1), whole, rank, True


def _keys(
    meta: Mapping[str, Any], names: list[str], strict: bool
) -> tuple[tuple[str, ...], tuple[str, ...]]:
    saved = set(meta["tensors"])
    missing = tuple(n for n in names if n not in saved)
    unexpected = tuple(sorted(saved - set(names)))
    if strict and (missing or unexpected):
        raise CheckpointError(
            f"the checkpoint and `like` differ: missing from the checkpoint {list(missing)[:8]}, "
            f"not asked for {list(unexpected)[:8]}; pass strict=False to load the common keys"
        )
    return missing, unexpected


def _check_files(tag_dir: Path, meta: Mapping[str, Any], members: Members, verify: bool) -> None:
    for index, (file, expected) in enumerate(sorted(meta["files"].items())):
        mine = index % members.world_size == members.rank
        check_file(tag_dir / file, expected, checksum=verify and mine)


def _fill(
    tag_dir: Path, meta: Mapping[str, Any], items: list[tuple[str, StateValue]], rank: int
) -> None:
    with contextlib.ExitStack() as stack:
        reader = _Reader(tag_dir, stack)
        for name, value in items:
            entry = meta["tensors"].get(name)
            if entry is None:
                continue
            dest, target, target_rank, linear = _target(name, value, rank)
            saved = ShardMap.from_json(entry["shard_map"])
            copies = plan_copies(name, saved, target, target_rank, linear)
            with torch.no_grad():
                apply_copies(dest, copies, reader.reader(name, entry["files"]))


def _agree(members: Members, error: str | None, what: str, timeout_s: float) -> None:
    outcomes = all_gather_json(error, members, timeout_s=timeout_s, what=what)
    failures = [f"rank {r}: {e}" for r, e in enumerate(outcomes) if e is not None]
    if failures:
        raise CheckpointError("; ".join(failures))


def _attempt(step: Any) -> str | None:
    try:
        step()
    except CheckpointError as exc:
        return str(exc)
    return None


def load(
    load_dir: str | os.PathLike[str],
    like: Mapping[str, StateValue],
    *,
    tag: str | None = None,
    group: Group | None = None,
    strict: bool = True,
    verify_checksums: bool = True,
    after: SaveHandle | None = None,
    timeout_s: float = 600.0,
) -> LoadResult:
    """Fill the tensors of ``like`` in place from a checkpoint; collective over ``group``.

    Args:
        load_dir: The checkpoint directory (the parent of the tags).
        like: What to fill: replicated tensors (filled whole on every rank) and
            `ShardedTensor` values (each rank's pieces), in any layout; the checkpoint is
            resharded to it.
        tag: The tag to read; ``None`` reads the one ``latest`` names.
        group: The ranks loading; the world by default, none without ``torch.distributed``.
        strict: Refuse keys present on one side only.
        verify_checksums: Check every file's SHA-256 (shared between the ranks) first.
        after: A background save to wait for first (its error is raised here).
        timeout_s: Longest wait for the other ranks.

    Raises:
        CheckpointError: No such tag, damaged files, mismatched keys or shapes.
    """
    if after is not None:
        after.wait()
    items = state_items(like)
    members = members_of(group)
    found: dict[str, Any] = {}

    def check() -> None:
        found["dir"] = resolve_tag_dir(load_dir, tag)
        found["meta"] = read_metadata(found["dir"])
        found["keys"] = _keys(found["meta"], [n for n, _ in items], strict)
        _check_files(found["dir"], found["meta"], members, verify_checksums)

    _agree(members, _attempt(check), "the checkpoint checks", timeout_s)
    error = _attempt(lambda: _fill(found["dir"], found["meta"], items, members.rank))
    _agree(members, error, "the end of loading", timeout_s)
    missing, unexpected = found["keys"]
    return LoadResult(found["dir"], dict(found["meta"]["metadata"]), missing, unexpected)


def load_state_dict_from_checkpoint(
    path_or_dir: str | os.PathLike[str], tag: str | None = None, *, verify_checksums: bool = True
) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint, whole, on CPU, in this process (no process group).

    Args:
        path_or_dir: A tag directory, or the checkpoint directory (then ``tag`` or ``latest``).
        tag: The tag when ``path_or_dir`` is the checkpoint directory.
        verify_checksums: Check every file's SHA-256 first.
    """
    tag_dir = tag_dir_of(path_or_dir, tag)
    meta = read_metadata(tag_dir)
    _check_files(tag_dir, meta, Members(None, 0, 1), verify_checksums)
    out: dict[str, torch.Tensor] = {}
    for name, entry in sorted(meta["tensors"].items()):
        smap = entry["shard_map"]
        out[name] = torch.empty(tuple(smap["global_shape"]), dtype=torch_dtype(smap["dtype"]))
    _fill(tag_dir, meta, list(out.items()), 0)
    return out
