"""A direct fill's blocks are checked from the bytes where they landed (`_landed`): each block
is fed from the reads that cover it, and from the file between them, in file order."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import xxhash

from deepshard.checkpoint import _block_read, _landed
from deepshard.checkpoint._block_read import BlockDigests
from deepshard.checkpoint._direct_fill import DirectRead, fill_direct
from deepshard.interface.errors import CheckpointError

_BLOCK = 4096  # small blocks: many of them, each with reads, gaps and read boundaries inside


def _file(tmp_path: Path) -> tuple[bytes, BlockDigests]:
    data = os.urandom(7 * _BLOCK + 123)
    (tmp_path / "f").write_bytes(data)
    blocks = [data[lo : lo + _BLOCK] for lo in range(0, len(data), _BLOCK)]
    return data, BlockDigests.xxh3([xxhash.xxh3_64(b).hexdigest() for b in blocks])


def _reads(spans: list[tuple[int, int]]) -> list[DirectRead]:
    return [DirectRead("f", lo, memoryview(bytearray(hi - lo))) for lo, hi in spans]


# Spans of the file read into destinations: a gap before the first (a header), one inside a
# block, one straddling a block boundary, a read spanning several blocks, an overlapping pair
# (the same bytes loaded into two tensors), and a read ending inside the last, short block.
_SPANS = [
    (100, 2000),
    (2500, 5000),
    (5000, 3 * _BLOCK + 17),
    (3 * _BLOCK, 3 * _BLOCK + 900),
    (4 * _BLOCK + 8, 6 * _BLOCK + 40),
    (7 * _BLOCK + 3, 7 * _BLOCK + 100),
]


@pytest.fixture(autouse=True)
def _small_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_landed, "BLOCK_BYTES", _BLOCK)
    monkeypatch.setattr(_block_read, "BLOCK_BYTES", _BLOCK)  # the messages' byte ranges


def _check(tmp_path: Path, reads: list[DirectRead], blocks: set[int], digests: BlockDigests,
           size: int) -> None:  # fmt: skip
    _landed.check_landed(tmp_path, reads, {"f": blocks}, {"f": digests}, {"f": size})


def test_every_block_checks_from_its_reads_and_the_gaps(tmp_path: Path) -> None:
    data, digests = _file(tmp_path)
    reads = _reads(_SPANS)
    fill_direct(tmp_path, reads)
    assert all(bytes(r.target) == data[r.offset : r.offset + len(r.target)] for r in reads)
    everything = set(range(len(digests.digests)))
    _check(tmp_path, reads, everything, digests, len(data))
    _check(tmp_path, [], everything, digests, len(data))  # nothing landed: all from the file
    _check(tmp_path, reads[::-1], {0, 6, 7}, digests, len(data))  # any order, some blocks


def test_a_damaged_landed_byte_names_its_block(tmp_path: Path) -> None:
    data, digests = _file(tmp_path)
    reads = _reads(_SPANS)
    fill_direct(tmp_path, reads)
    reads[4].target[2 * _BLOCK] ^= 0x01  # file byte 6 * _BLOCK + 8: block 6
    start = 6 * _BLOCK
    message = rf"f does not match its XXH3-64 .*bytes \[{start}, .*partly overwritten"
    with pytest.raises(CheckpointError, match=message):
        _check(tmp_path, reads, set(range(8)), digests, len(data))
    _check(tmp_path, reads, {0, 1, 2, 3, 4, 5, 7}, digests, len(data))  # block 6 not asked


def test_the_first_of_overlapping_reads_counts_and_gaps_come_from_the_file(
    tmp_path: Path,
) -> None:
    data, digests = _file(tmp_path)
    reads = _reads(_SPANS)
    fill_direct(tmp_path, reads)
    reads[3].target[0] ^= 0x01  # overlaps reads[2], which starts first and holds the byte
    _check(tmp_path, reads, set(range(8)), digests, len(data))
    damaged = bytearray(data)
    damaged[2200] ^= 0x01  # in the gap between the first two reads: read from the file
    (tmp_path / "f").write_bytes(bytes(damaged))
    with pytest.raises(CheckpointError, match=r"bytes \[0, 4096\)"):
        _check(tmp_path, reads, {0}, digests, len(data))


def test_a_block_past_the_digests_or_the_file_is_refused(tmp_path: Path) -> None:
    data, digests = _file(tmp_path)
    with pytest.raises(CheckpointError, match=r"bytes \[32768,"):
        _check(tmp_path, [], {8}, digests, len(data))
    short = BlockDigests.xxh3(digests.digests[:3])
    with pytest.raises(CheckpointError, match=r"bytes \[12288,"):
        _check(tmp_path, [], {3}, short, len(data))
