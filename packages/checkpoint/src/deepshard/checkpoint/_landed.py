"""Filling straight into place and checking the bytes where they landed.

`_direct_fill` reads plain byte ranges of the data files straight into the caller's tensors.
With a digest faster than memory copies (XXH3-64, format 3), the load checks those bytes after
they landed instead of reading every block twice (once to check it, once more from the page
cache to fill): `fill_checked` performs the reads in file order on the calling thread and,
as soon as no read still to come can touch a needed block, hands it to a helper thread, where
`LandedBlocks` feeds the block's bytes to a fresh digest, taking each range from the
destination that received it and reading only the bytes no read put anywhere (the header,
alignment gaps, entries or parts of entries this rank does not load) from the file, through
one block-sized buffer. The hashing overlaps the next reads, on bytes still in the caches.

The check sees exactly the bytes the caller got: a file rewritten between a check and a fill
cannot slip past it. It costs one pass over the loaded memory (XXH3 hashes ~19 GB/s per core
on the machines measured) where the earlier design paid a copy out of the page cache. Its
price: a block that does not match is found after its bytes were written into the
destination (``load`` turns the error into a `PartialLoadError` saying so).

Algorithm, for one file, its reads sorted by file offset and its needed blocks in order: a
cursor walks each block ``[lo, hi)`` from ``lo``. The reads that end at or before the cursor
are passed over (a prefix of them is dropped for good once it ends before the block: blocks
only move forward); the read holding the cursor gives its bytes up to its end or ``hi``; if
the next read starts after the cursor, or none is left, the gap up to it (or ``hi``) is read
from the file. Reads may overlap (two destinations filled from the same bytes): the first
one holding the cursor is used. A block is ready once the read after the last one performed
starts at or after the block's end: every read that overlaps it starts before that end, so
it is one of those performed.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from deepshard.checkpoint._block_read import BlockDigests, Hasher, mismatch
from deepshard.checkpoint._direct_fill import DirectRead, read_into
from deepshard.checkpoint._safetensors_io import BLOCK_BYTES
from deepshard.interface.errors import CheckpointError

__all__ = ["BlockCheck", "LandedBlocks", "fill_checked"]


@dataclass(frozen=True)
class BlockCheck:
    """The blocks of one data file to check where they landed.

    Attributes:
        blocks: Their indices.
        digests: The file's saved block digests.
        size: The file's length (already checked against the metadata).
    """

    blocks: set[int]
    digests: BlockDigests
    size: int


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
        read_into(self.fd, view, lo, self.path)
        return view

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)


def _end(read: DirectRead) -> int:
    return read.offset + len(read.target)


def _feed_block(digest: Hasher, reads: Sequence[DirectRead], first: int, lo: int, hi: int,
                gaps: _Gaps) -> None:  # fmt: skip
    """Feed bytes ``[lo, hi)`` to ``digest`` from ``reads[first:]`` and, between them, the file."""
    at, index = lo, first
    while at < hi:
        read = reads[index] if index < len(reads) else None
        if read is not None and _end(read) <= at:
            index += 1  # wholly behind the cursor
            continue
        if read is None or read.offset > at:  # nothing holds the cursor: from the file
            stop = hi if read is None else min(hi, read.offset)
            digest.update(gaps.read(at, stop))
            at = stop
            continue
        stop = min(hi, _end(read))
        digest.update(read.target[at - read.offset : stop - read.offset])
        at = stop


class LandedBlocks:
    """Checks blocks of one file from the reads that landed (and the file between them).

    ``reads`` are the file's reads sorted by offset. Blocks must be asked for in increasing
    order, over any number of `check` calls; one thread at a time.
    """

    def __init__(self, path: Path, reads: Sequence[DirectRead], size: int,
                 expected: BlockDigests) -> None:  # fmt: skip
        self.path, self.size, self.expected, self.reads = path, size, expected, reads
        self.gaps = _Gaps(path)
        self.first = 0  # reads before this one end before the next block asked for

    def check(self, indices: Sequence[int]) -> None:
        """Check ``indices`` (increasing, after those of earlier calls).

        Raises:
            CheckpointError: A block does not match, lies past the digests or the file, or a
                gap cannot be read.
        """
        expected, reads = self.expected, self.reads
        try:
            for index in indices:
                lo, hi = index * BLOCK_BYTES, min(self.size, (index + 1) * BLOCK_BYTES)
                if index >= len(expected.digests) or lo >= self.size:
                    raise mismatch(self.path, index, expected)
                while self.first < len(reads) and _end(reads[self.first]) <= lo:
                    self.first += 1
                digest = expected.start()
                _feed_block(digest, reads, self.first, lo, hi, self.gaps)
                if not expected.matches(index, digest.hexdigest()):
                    raise mismatch(self.path, index, expected)
        except OSError as exc:
            raise CheckpointError(f"{self.path}: cannot read ({exc}); the file is damaged") from exc

    def close(self) -> None:
        """Close the file the gaps were read from."""
        self.gaps.close()


def fill_checked(
    tag_dir: Path, reads: Sequence[DirectRead], checks: Mapping[str, BlockCheck]
) -> int:
    """Perform ``reads`` and check ``blocks`` of each file where their bytes landed.

    The reads run on this thread in file order, one file after another (one sequential stream,
    what a disk reads fastest); each needed block is checked on a helper thread as soon as no
    read still to come can touch it (the next read starts at or after the block's end), so the
    hashing overlaps the next reads while the block's bytes are still in the caches.

    Args:
        tag_dir: The tag directory holding the files.
        reads: What to read where (`_direct_fill.direct_reads`).
        checks: The blocks to check, by file.

    Returns:
        The number of bytes read into the destinations.

    Raises:
        CheckpointError: A read fails, or a block does not match its digest.
    """
    by_file: dict[str, list[DirectRead]] = {file: [] for file in checks}
    for read in reads:
        by_file.setdefault(read.file, []).append(read)
    total = 0
    pending: list[Future[None]] = []
    checkers: list[LandedBlocks] = []
    try:
        with ThreadPoolExecutor(1, "deepshard-checkpoint-landed") as helper:
            for file, file_reads in sorted(by_file.items()):
                path = tag_dir / file
                file_reads.sort(key=lambda read: read.offset)
                check = checks.get(file)
                wanted = sorted(check.blocks) if check is not None else []
                checker = None
                if check is not None and wanted:
                    checker = LandedBlocks(path, file_reads, check.size, check.digests)
                    checkers.append(checker)
                total += _read_file(path, file_reads, wanted, checker, helper, pending)
            for future in pending:
                future.result()  # the first mismatch, in file order
    finally:
        for checker in checkers:
            checker.close()
    return total


def _read_file(path: Path, reads: list[DirectRead], wanted: list[int],
               checker: LandedBlocks | None, helper: ThreadPoolExecutor,
               checks: list[Future[None]]) -> int:  # fmt: skip
    """Read ``reads`` (sorted) of ``path``, handing ``checker`` each block once it is ready."""
    total, ready = 0, 0
    try:
        fd = os.open(path, os.O_RDONLY) if reads else -1
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read ({exc}); it is damaged") from exc
    try:
        for position, read in enumerate(reads):
            total += read_into(fd, read.target, read.offset, path)
            after = reads[position + 1].offset if position + 1 < len(reads) else None
            done = ready
            while done < len(wanted) and (
                after is None or (wanted[done] + 1) * BLOCK_BYTES <= after
            ):
                done += 1  # no read still to come can touch this block
            if checker is not None and done > ready:
                checks.append(helper.submit(checker.check, wanted[ready:done]))
                ready = done
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read ({exc}); it is damaged") from exc
    finally:
        if fd >= 0:
            os.close(fd)
    if checker is not None and ready < len(wanted):  # blocks no read touched
        checks.append(helper.submit(checker.check, wanted[ready:]))
    return total
