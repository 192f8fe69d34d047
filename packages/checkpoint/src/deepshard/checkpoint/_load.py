"""``load`` into live shards (resharding on the fly) and consolidated loading in one process.

A load first checks what it can without touching the caller's tensors: every rank checks the
size of every file, reads the metadata, matches the keys and plans its copies; then the ranks
agree that all checks passed. Filling has two paths. A copy that is a plain byte range into
CPU storage of the saved dtype (the common case, resharded or not) is read straight into the
destination with ``preadv`` (`_direct_fill`), and the 16 MiB blocks it read are then checked
against the per-block XXH3-64 the save recorded from the bytes where they landed (`_landed`):
the disk is read once, and the check sees exactly what the caller got. Every other copy (a
scale, a dtype cast, an accelerator destination) reads its blocks into host buffers, checks
them as they arrive (`_block_read.read_regions`), and is filled by `_reshard` from views of
them. A checkpoint older than format 3 has only SHA-256 block digests, slower than the disk:
its direct copies' blocks are checked first, on threads, and then read from the page cache.

A final exchange makes an error on one rank an error on all of them. An error in the fill
phase (a block that does not match where it landed, a file cut short since the check) is a
`PartialLoadError`: the tensors were partly overwritten, and must be loaded again before use.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from deepshard.checkpoint._block_read import (
    BlockDigests,
    Region,
    read_regions,
    verify_blocks,
    view_of,
)
from deepshard.checkpoint._direct_fill import FillTask, direct_reads, fill_direct, split_direct
from deepshard.checkpoint._exchange import Members, all_gather_json, members_of
from deepshard.checkpoint._handle import SaveHandle
from deepshard.checkpoint._landed import BlockCheck, fill_checked
from deepshard.checkpoint._layout import METADATA, read_metadata, resolve_tag_dir, tag_dir_of
from deepshard.checkpoint._reshard import apply_copies, plan_copies, source_ranges
from deepshard.checkpoint._safetensors_io import (
    BLOCK_BYTES,
    digest_of_blocks,
    read_header,
    sha256_of,
)
from deepshard.checkpoint._types import LoadResult, ShardedTensor, StateValue, state_items
from deepshard.comm import Group
from deepshard.interface import ShardMap, ShardPiece
from deepshard.interface.errors import CheckpointError, PartialLoadError

__all__ = ["load", "load_state_dict_from_checkpoint", "torch_dtype"]

_OVERWRITTEN = (
    "; the tensors being loaded were already filled from the files and are now partly "
    "overwritten: load a good checkpoint (or rebuild them) before using them"
)
"""What an error of the fill phase adds to its message (`PartialLoadError`)."""

_THREADS = 8  # hash / read threads of one rank (hashing one block is ~1.3 GB/s per core)


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype a shard map names (``"bfloat16"``)."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"unknown dtype {name!r} in checkpoint metadata")
    return dtype


def check_file(
    path: Path, expected: Mapping[str, Any], *, checksum: bool, version: int = 2
) -> None:
    """Raise `CheckpointError` naming ``path`` if it is missing, truncated or tampered with.

    With ``checksum`` the whole file is read: format 1 compares its SHA-256, formats 2-3 each
    block's SHA-256 (on several threads; and the block list's digest, so the metadata's list is
    checked too), and format 3 each block's XXH3-64 as well (what a load checks).
    """
    try:
        size = path.stat().st_size
    except FileNotFoundError as exc:
        raise CheckpointError(f"{path} is missing; the checkpoint is incomplete") from exc
    if size != expected["size"]:
        raise CheckpointError(
            f"{path} has {size} bytes, the metadata says {expected['size']}: it is truncated "
            "or was replaced; restore it or load another tag"
        )
    if not checksum:
        return
    if version >= 2:
        digests = list(expected["block_sha256"])
        intact = digest_of_blocks(digests) == expected["sha256"]
        intact = intact and len(digests) == -(-size // BLOCK_BYTES)
        fast = expected.get("block_xxh3")
        intact = intact and (fast is None or len(fast) == len(digests))
        if intact:  # every block, hashed on several threads at once
            every = set(range(len(digests)))
            with _pool() as pool:
                verify_blocks(path, every, size, BlockDigests.sha256(digests), pool)
                if fast is not None:  # from the page cache the first pass filled
                    verify_blocks(path, every, size, BlockDigests.xxh3(fast), pool)
    else:
        intact = sha256_of(path).sha256 == expected["sha256"]
    if not intact:
        raise CheckpointError(
            f"{path} does not match its SHA-256 in the metadata: it is corrupt or was modified; "
            "restore it or load another tag"
        )


class _Reader:
    """Reads flat ranges of entries from the regions `read_regions` brought into memory."""

    def __init__(self, tag_dir: Path, regions: Mapping[str, list[Region]]) -> None:
        self.tag_dir = tag_dir
        self.regions = regions
        self.headers: dict[str, tuple[int, dict[str, tuple[int, int]]]] = {}

    def reader(self, task: FillTask) -> Any:
        def read(rank: int, start: int, stop: int) -> torch.Tensor:
            file = task.files.get(str(rank))
            if file is None:
                raise CheckpointError(
                    f"{task.name}: the metadata names no file for rank {rank}'s shard"
                )
            if file not in self.headers:
                self.headers[file] = read_header(self.tag_dir / file)
            data_start, spans = self.headers[file]
            begin = data_start + spans[task.name][0] + start * task.itemsize
            end = begin + (stop - start) * task.itemsize
            where = str(self.tag_dir / file)
            return view_of(self.regions.get(file, []), begin, end, task.dtype, where)

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


def _plan(
    meta: Mapping[str, Any], items: list[tuple[str, StateValue]], rank: int
) -> list[FillTask]:
    tasks = []
    for name, value in items:
        entry = meta["tensors"].get(name)
        if entry is None:
            continue
        dest, target, target_rank, linear = _target(name, value, rank)
        saved = ShardMap.from_json(entry["shard_map"])
        copies = plan_copies(name, saved, target, target_rank, linear)
        tasks.append(FillTask(name, dest, copies, dict(entry["files"]), torch_dtype(saved.dtype)))
    return tasks


def _needed_blocks(tag_dir: Path, tasks: list[FillTask]) -> dict[str, set[int]]:
    """The hashed blocks of each file holding bytes the ``tasks`` read (their bounding ranges)."""
    headers: dict[str, tuple[int, dict[str, tuple[int, int]]]] = {}
    needed: dict[str, set[int]] = {}
    for task in tasks:
        for rank, (lo, hi) in source_ranges(task.copies).items():
            file = task.files.get(str(rank))
            if file is None:
                raise CheckpointError(f"{task.name}: the metadata names no file for rank {rank}")
            if file not in headers:
                headers[file] = read_header(tag_dir / file)
            data_start, spans = headers[file]
            if task.name not in spans:
                raise CheckpointError(f"{tag_dir / file} has no entry {task.name!r}; it is damaged")
            first = data_start + spans[task.name][0] + lo * task.itemsize
            last = data_start + spans[task.name][0] + hi * task.itemsize - 1
            needed.setdefault(file, set()).update(
                range(first // BLOCK_BYTES, last // BLOCK_BYTES + 1)
            )
    return needed


def _expected_digests(
    tag_dir: Path, meta: Mapping[str, Any], file: str, *, verify: bool
) -> BlockDigests | None:
    """The block digests to check ``file`` against (``None``: nothing to check block-wise).

    The XXH3-64 list where the checkpoint has one (format 3), else the SHA-256 list; either
    way the SHA-256 list must still give the file's ``sha256`` and the lists must agree in
    length, so an edited list is caught even where no block of it is read.
    """
    if not verify:
        return None
    expected = meta["files"][file]
    digests: list[str] | None = expected.get("block_sha256")
    if digests is None:  # an early format-1 file without block digests
        check_file(tag_dir / file, expected, checksum=True, version=1)
        return None
    fast: list[str] | None = expected.get("block_xxh3")
    if (int(meta["format_version"]) >= 2 and digest_of_blocks(digests) != expected["sha256"]) or (
        fast is not None and len(fast) != len(digests)
    ):
        raise CheckpointError(
            f"{tag_dir / METADATA}: the block digests of {file} do not match its "
            "sha256: the metadata was modified; restore it or load another tag"
        )
    return BlockDigests.sha256(digests) if fast is None else BlockDigests.xxh3(fast)


def _pool() -> ThreadPoolExecutor:
    """Threads for hashing and reading: one per usable core, at most `_THREADS`."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return ThreadPoolExecutor(max(1, min(_THREADS, cores or 1)), "deepshard-checkpoint-read")


def _read_needed(
    tag_dir: Path, meta: Mapping[str, Any], needed: dict[str, set[int]], *, verify: bool
) -> dict[str, list[Region]]:
    """The needed blocks of every file, read and (with ``verify``) checked against the metadata."""
    out: dict[str, list[Region]] = {}
    with _pool() as pool:
        for file, blocks in sorted(needed.items()):
            digests = _expected_digests(tag_dir, meta, file, verify=verify)
            size = int(meta["files"][file]["size"])
            out[file] = read_regions(tag_dir / file, blocks, size, digests, pool)
    return out


@dataclass
class _Prepared:
    """What the check phase hands the fill phase.

    Attributes:
        direct: The copies read straight into place.
        buffered: The other copies, filled from ``regions``.
        regions: The blocks the buffered copies read, in memory (checked).
        landed: The blocks of each file to check after the direct fill, from where they
            landed (a fast digest).
        warm: Whether the direct copies' blocks were checked first (a slow digest), so the
            fill reads them from the page cache.
    """

    direct: list[FillTask]
    buffered: list[FillTask]
    regions: dict[str, list[Region]]
    landed: dict[str, BlockCheck] = field(default_factory=dict)
    warm: bool = False


def _prepare(
    tag_dir: Path,
    meta: Mapping[str, Any],
    tasks: list[FillTask],
    *,
    verify: bool,
    check_first: bool = False,
) -> _Prepared:
    """Check what ``tasks`` read, or plan to check it where it lands; read the buffered data."""
    direct, buffered = split_direct(tasks)
    in_buffers = _needed_blocks(tag_dir, buffered)
    prepared = _Prepared(direct, buffered, _read_needed(tag_dir, meta, in_buffers, verify=verify))
    needed = _needed_blocks(tag_dir, direct)  # also checks that every entry is in its file
    if not verify:
        return prepared
    with _pool() as pool:
        for file, wanted in sorted(needed.items()):
            blocks = wanted - in_buffers.get(file, set())
            digests = _expected_digests(tag_dir, meta, file, verify=True)
            if digests is None or not blocks:
                continue
            size = int(meta["files"][file]["size"])
            if digests.threaded or check_first:  # a slow digest: checked first, on threads
                verify_blocks(tag_dir / file, blocks, size, digests, pool)
                prepared.warm = True
            else:
                prepared.landed[file] = BlockCheck(blocks, digests, size)
    return prepared


def _fill(tag_dir: Path, prepared: _Prepared) -> int:
    """Fill every copy; check the direct ones' blocks where they landed; return bytes read."""
    read = _apply(tag_dir, prepared.buffered, prepared.regions)
    reads = direct_reads(tag_dir, prepared.direct)
    if prepared.landed:
        return read + fill_checked(tag_dir, reads, prepared.landed)
    # Threads only copy from a page cache a check filled: reads from the disk measured faster
    # on one thread (0.24 s vs 0.33 s for 400 MB on the shared box).
    with _pool() as pool:
        read += fill_direct(tag_dir, reads, pool if prepared.warm else None)
    return read


def _check_files(tag_dir: Path, meta: Mapping[str, Any], *, checksum: bool) -> None:
    for file, expected in sorted(meta["files"].items()):
        version = int(meta["format_version"])
        check_file(tag_dir / file, expected, checksum=checksum, version=version)


def _apply(tag_dir: Path, tasks: list[FillTask], regions: Mapping[str, list[Region]]) -> int:
    """Perform the tasks' copies from ``regions``; return the number of tensor bytes read."""
    bytes_read = 0
    reader = _Reader(tag_dir, regions)
    with torch.no_grad():
        for task in tasks:
            elements = apply_copies(task.dest, task.copies, reader.reader(task))
            bytes_read += elements * task.itemsize
    return bytes_read


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
    check_first: bool = False,
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
        verify_checksums: Check the digest of every block of the files this rank reads
            (every file's size is always checked, before anything is filled).
        check_first: Check every block before writing anything into ``like``, so that a
            damaged file leaves it untouched; the blocks filled straight into place are then
            read twice (the second time from the page cache). By default they are checked
            where they landed.
        after: A background save to wait for first (its error is raised here).
        timeout_s: Longest wait for the other ranks.

    Raises:
        CheckpointError: No such tag, damaged files, mismatched keys or shapes, found before
            anything was written into ``like``.
        PartialLoadError: A damaged block found while or after filling (the `CheckpointError`
            subclass saying ``like``'s tensors were partly overwritten).
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
        _check_files(found["dir"], found["meta"], checksum=False)
        tasks = _plan(found["meta"], items, members.rank)
        found["prepared"] = _prepare(
            found["dir"], found["meta"], tasks, verify=verify_checksums, check_first=check_first
        )

    _agree(members, _attempt(check), "the checkpoint checks", timeout_s)

    def fill() -> None:
        found["read"] = _fill(found["dir"], found.pop("prepared"))

    try:
        _agree(members, _attempt(fill), "the end of loading", timeout_s)
    except CheckpointError as exc:
        raise PartialLoadError(f"{exc}{_OVERWRITTEN}") from exc
    missing, unexpected = found["keys"]
    metadata = dict(found["meta"]["metadata"])
    return LoadResult(found["dir"], metadata, missing, unexpected, found["read"])


def load_state_dict_from_checkpoint(
    path_or_dir: str | os.PathLike[str], tag: str | None = None, *, verify_checksums: bool = True
) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint, whole, on CPU, in this process (no process group).

    Args:
        path_or_dir: A tag directory, or the checkpoint directory (then ``tag`` or ``latest``).
        tag: The tag when ``path_or_dir`` is the checkpoint directory.
        verify_checksums: Check the digest of every block read.
    """
    tag_dir = tag_dir_of(path_or_dir, tag)
    meta = read_metadata(tag_dir)
    _check_files(tag_dir, meta, checksum=False)
    out: dict[str, torch.Tensor] = {}
    for name, entry in sorted(meta["tensors"].items()):
        smap = entry["shard_map"]
        out[name] = torch.empty(tuple(smap["global_shape"]), dtype=torch_dtype(smap["dtype"]))
    tasks = _plan(meta, list(out.items()), 0)
    _fill(tag_dir, _prepare(tag_dir, meta, tasks, verify=verify_checksums))
    return out
