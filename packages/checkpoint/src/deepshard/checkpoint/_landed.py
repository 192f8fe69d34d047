"""Checking the bytes a direct fill put in place, where they landed.

`_direct_fill.fill_direct` reads plain byte ranges of the data files straight into the caller's
tensors. With a digest faster than memory copies (XXH3-64, format 3), the load checks those
bytes after they landed instead of reading every block twice (once to check it, once more from
the page cache to fill): for each needed block, in file order, `check_landed` feeds the
block's bytes to a fresh digest, taking each range from the destination that received it and
reading only the bytes no read put anywhere (the header, the alignment gaps, entries or parts
of entries this rank does not load) from the file, through one block-sized buffer.

The check sees exactly the bytes the caller got: a file rewritten between a check and a fill
cannot slip past it. It costs one pass over the loaded memory (XXH3 hashes ~19 GB/s per core
on the machines measured) where the earlier design paid a copy out of the page cache. Its
price: a block that does not match is found after its bytes were written into the
destination, so the error says that the tensors being loaded were partly overwritten.

Algorithm, for one file, its reads sorted by file offset and its needed blocks in order: a
cursor walks each block ``[lo, hi)`` from ``lo``. The reads that end at or before the cursor
are passed over (a prefix of them is dropped for good once it ends before the block: blocks
only move forward); the read holding the cursor gives its bytes up to its end or ``hi``; if
the next read starts after the cursor, or none is left, the gap up to it (or ``hi``) is read
from the file. Reads may overlap (two destinations filled from the same bytes): the first
one holding the cursor is used.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path

from deepshard.checkpoint._block_read import BlockDigests, Hasher, mismatch
from deepshard.checkpoint._direct_fill import DirectRead
from deepshard.checkpoint._safetensors_io import BLOCK_BYTES
from deepshard.interface.errors import CheckpointError

__all__ = ["OVERWRITTEN", "check_landed"]

OVERWRITTEN = (
    "; the tensors being loaded were already filled from the file and are now partly "
    "overwritten: load a good checkpoint (or rebuild them) before using them"
)
"""What a mismatch found after the fill adds to its message."""


class _Gaps:
    """Reads the bytes of a file no destination holds, through one reused buffer."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.fd = -1
        self.buffer = memoryview(bytearray(0))

    def read(self, lo: int, hi: int) -> memoryview:
        if self.fd < 0:
            self.fd = os.open(self.path, os.O_RDONLY)
            self.buffer = memoryview(bytearray(BLOCK_BYTES))
        view = self.buffer[: hi - lo]
        done = 0
        while done < len(view):
            got = os.preadv(self.fd, [view[done:]], lo + done)
            if not got:
                raise CheckpointError(f"{self.path} ended at byte {lo + done}: truncated")
            done += got
        return view

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)


def _feed_block(digest: Hasher, reads: Sequence[DirectRead], first: int, lo: int, hi: int,
                gaps: _Gaps) -> None:  # fmt: skip
    """Feed bytes ``[lo, hi)`` to ``digest`` from ``reads[first:]`` and, between them, the file."""
    at, index = lo, first
    while at < hi:
        read = reads[index] if index < len(reads) else None
        if read is not None and read.offset + len(read.target) <= at:
            index += 1  # wholly behind the cursor
            continue
        if read is None or read.offset > at:  # nothing holds the cursor: from the file
            stop = hi if read is None else min(hi, read.offset)
            digest.update(gaps.read(at, stop))
            at = stop
            continue
        stop = min(hi, read.offset + len(read.target))
        digest.update(read.target[at - read.offset : stop - read.offset])
        at = stop


def _check_file(path: Path, reads: list[DirectRead], order: list[int], size: int,
                expected: BlockDigests) -> None:  # fmt: skip
    if order[-1] >= len(expected.digests) or order[-1] * BLOCK_BYTES >= size:
        raise mismatch(path, order[-1], expected, OVERWRITTEN)
    reads = sorted(reads, key=lambda read: read.offset)
    gaps = _Gaps(path)
    first = 0
    try:
        for index in order:
            lo, hi = index * BLOCK_BYTES, min(size, (index + 1) * BLOCK_BYTES)
            while first < len(reads) and reads[first].offset + len(reads[first].target) <= lo:
                first += 1
            digest = expected.start()
            _feed_block(digest, reads, first, lo, hi, gaps)
            if not expected.matches(index, digest.hexdigest()):
                raise mismatch(path, index, expected, OVERWRITTEN)
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read ({exc}); the file is damaged") from exc
    finally:
        gaps.close()


def check_landed(
    tag_dir: Path,
    reads: Sequence[DirectRead],
    blocks: Mapping[str, set[int]],
    digests: Mapping[str, BlockDigests],
    sizes: Mapping[str, int],
) -> None:
    """Check ``blocks`` of each file against ``digests``, from the bytes ``reads`` put in place.

    Args:
        tag_dir: The tag directory holding the files.
        reads: The reads `fill_direct` performed (their targets hold the file's bytes now).
        blocks: The block indices to check, by file.
        digests: Each file's saved block digests.
        sizes: Each file's length (already checked against the metadata).

    Raises:
        CheckpointError: A block does not match its digest (the message says the destinations
            were partly overwritten), or a gap cannot be read.
    """
    by_file: dict[str, list[DirectRead]] = {}
    for read in reads:
        by_file.setdefault(read.file, []).append(read)
    for file, wanted in sorted(blocks.items()):
        if wanted:
            path = tag_dir / file
            _check_file(path, by_file.get(file, []), sorted(wanted), sizes[file], digests[file])
