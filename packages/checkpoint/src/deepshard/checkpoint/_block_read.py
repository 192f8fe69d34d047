"""Reading the needed blocks of a data file in large sequential reads, verified as they arrive.

A save records the SHA-256 of every `BLOCK_BYTES` block of each file. A load knows, from its
copy plan, which blocks hold bytes it will use; it reads each run of consecutive needed blocks
into one host buffer with a few large ``readinto`` calls (straight into the buffer: no copy)
and hashes each block on a thread pool while the next one is read (hashlib releases the GIL).
So a rank reads only the blocks it needs, reads each byte from disk once, and checks exactly
what it read before anything reaches the caller's tensors; the fill then takes views of these
buffers instead of reading the file again piece by piece.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from deepshard.checkpoint._safetensors_io import BLOCK_BYTES, bytes_of
from deepshard.interface.errors import CheckpointError

__all__ = [
    "Region",
    "block_runs",
    "read_regions",
    "stream_block_digests",
    "verify_blocks",
    "view_of",
]

_READ_BYTES = 4 * BLOCK_BYTES  # one readinto: large enough for the disk's sequential speed
_RING = 3  # reused block buffers of `verify_blocks`: one being read, two being hashed


@dataclass(frozen=True)
class Region:
    """A run of consecutive blocks of one file, held in memory.

    Attributes:
        start: The run's first byte in the file (a multiple of `BLOCK_BYTES`).
        data: Its bytes (``uint8``), up to the end of the run or of the file.
    """

    start: int
    data: torch.Tensor


def block_runs(blocks: set[int]) -> list[tuple[int, int]]:
    """The ``[first, last]`` index pairs of the runs of consecutive ``blocks``, in order."""
    runs: list[tuple[int, int]] = []
    for index in sorted(blocks):
        if runs and runs[-1][1] == index - 1:
            runs[-1] = (runs[-1][0], index)
        else:
            runs.append((index, index))
    return runs


def _mismatch(path: Path, index: int) -> CheckpointError:
    start = index * BLOCK_BYTES
    return CheckpointError(
        f"{path} does not match its SHA-256 in the metadata (bytes [{start}, "
        f"{start + BLOCK_BYTES})): it is corrupt or was modified; restore it or load another tag"
    )


def _digest(view: memoryview) -> str:
    return hashlib.sha256(view).hexdigest()


def read_regions(
    path: Path,
    blocks: set[int],
    size: int,
    expected: Sequence[str] | None,
    pool: ThreadPoolExecutor,
) -> list[Region]:
    """Read ``blocks`` of ``path`` (``size`` bytes long); check them against ``expected``.

    Args:
        path: The data file.
        blocks: Indices of the blocks to read.
        size: The file's length (already checked against the metadata).
        expected: The saved block digests, or ``None`` to read without verifying.
        pool: Threads that hash while this thread reads.

    Raises:
        CheckpointError: A block is short, unreadable or does not match its digest.
    """
    regions: list[Region] = []
    checks: list[tuple[int, Future[str]]] = []
    try:
        with open(path, "rb", buffering=0) as handle:
            for first, last in block_runs(blocks):
                start, stop = first * BLOCK_BYTES, min(size, (last + 1) * BLOCK_BYTES)
                data = torch.empty(max(0, stop - start), dtype=torch.uint8)
                view = bytes_of(data)
                handle.seek(start)
                done, pending = 0, first
                while done < len(view):
                    got = handle.readinto(view[done : done + _READ_BYTES])
                    if not got:
                        raise CheckpointError(f"{path} ended at byte {start + done}: truncated")
                    done += got
                    # Hash each block as soon as it is complete, while the next one is read.
                    while expected is not None and pending <= last:
                        lo = (pending - first) * BLOCK_BYTES
                        if min(lo + BLOCK_BYTES, len(view)) > done:
                            break
                        checks.append((pending, pool.submit(_digest, view[lo : lo + BLOCK_BYTES])))
                        pending += 1
                regions.append(Region(start, data))
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read ({exc}); the file is damaged") from exc
    for index, future in checks:
        if expected is None or index >= len(expected) or future.result() != expected[index]:
            raise _mismatch(path, index)
    return regions


def verify_blocks(
    path: Path,
    blocks: set[int],
    size: int,
    expected: Sequence[str],
    pool: ThreadPoolExecutor,
) -> None:
    """Check ``blocks`` of ``path`` against ``expected`` without keeping them.

    Each block is read into one of a few reused buffers (no fresh memory to page-fault) and
    hashed on ``pool`` while the next one is read. Used when the caller then reads the bytes
    again straight into their destination: that second read is served by the page cache this
    one filled.

    Raises:
        CheckpointError: A block is short, unreadable or does not match its digest.
    """
    ring = [torch.empty(BLOCK_BYTES, dtype=torch.uint8) for _ in range(min(_RING, len(blocks)))]
    views = [bytes_of(buffer) for buffer in ring]
    hashing: list[tuple[int, Future[str]] | None] = [None] * len(ring)

    def settle(slot: int) -> None:
        pending = hashing[slot]
        if pending is not None:
            index, future = pending
            if index >= len(expected) or future.result() != expected[index]:
                raise _mismatch(path, index)
            hashing[slot] = None

    try:
        with open(path, "rb", buffering=0) as handle:
            for count, index in enumerate(sorted(blocks)):
                slot = count % len(ring)
                settle(slot)  # its buffer is about to be overwritten
                start = index * BLOCK_BYTES
                view = views[slot][: max(0, min(BLOCK_BYTES, size - start))]
                handle.seek(start)
                done = 0
                while done < len(view):
                    got = handle.readinto(view[done:])
                    if not got:
                        raise CheckpointError(f"{path} ended at byte {start + done}: truncated")
                    done += got
                hashing[slot] = (index, pool.submit(_digest, view))
            for slot in range(len(ring)):
                settle(slot)
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read ({exc}); the file is damaged") from exc
    finally:
        for pending in hashing:  # do not free a buffer a hash thread still reads
            if pending is not None:
                pending[1].exception()


def stream_block_digests(path: Path) -> list[str]:
    """The digest of every block of ``path``, reading it once, sequentially."""
    digests = []
    with open(path, "rb") as handle:
        while block := handle.read(BLOCK_BYTES):
            digests.append(hashlib.sha256(block).hexdigest())
    return digests


def view_of(
    regions: Sequence[Region], begin: int, end: int, dtype: torch.dtype, where: str
) -> torch.Tensor:
    """Bytes ``[begin, end)`` of the file as a 1-D ``dtype`` tensor (a view when aligned)."""
    if begin == end:
        return torch.empty(0, dtype=dtype)
    for region in regions:
        offset = begin - region.start
        if offset >= 0 and end - region.start <= region.data.numel():
            raw = region.data[offset : offset + end - begin]
            if offset % dtype.itemsize:
                raw = raw.clone()  # an entry after an odd-sized one: views need alignment
            return raw.view(dtype)
    raise CheckpointError(f"{where}: internal error, bytes [{begin}, {end}) were not read")
