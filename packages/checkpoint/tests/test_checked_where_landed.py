"""A direct fill's blocks are checked from the bytes where they landed (`_landed`): each block
is fed from the reads that cover it, and from the file between them, in file order, as soon as
no later read can touch it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import xxhash

from deepshard.checkpoint import _block_read, _landed
from deepshard.checkpoint._block_read import BlockDigests
from deepshard.checkpoint._direct_fill import DirectRead
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


def _fill(tmp_path: Path, reads: list[DirectRead], blocks: set[int], digests: BlockDigests,
          size: int) -> int:  # fmt: skip
    return _landed.fill_checked(tmp_path, reads, {"f": _landed.BlockCheck(blocks, digests, size)})


def _damage(tmp_path: Path, data: bytes, at: int) -> None:
    damaged = bytearray(data)
    damaged[at] ^= 0x01
    (tmp_path / "f").write_bytes(bytes(damaged))


def test_every_block_checks_from_its_reads_and_the_gaps(tmp_path: Path) -> None:
    data, digests = _file(tmp_path)
    reads = _reads(_SPANS)
    everything = set(range(len(digests.digests)))
    assert _fill(tmp_path, reads[::-1], everything, digests, len(data)) == sum(
        hi - lo for lo, hi in _SPANS
    )
    assert all(bytes(r.target) == data[r.offset : r.offset + len(r.target)] for r in reads)
    assert _fill(tmp_path, [], everything, digests, len(data)) == 0  # all from the file
    _fill(tmp_path, _reads(_SPANS), {0, 6, 7}, digests, len(data))  # some blocks


def test_a_damaged_byte_names_its_block_whether_read_or_in_a_gap(tmp_path: Path) -> None:
    data, digests = _file(tmp_path)
    _damage(tmp_path, data, 6 * _BLOCK + 8)  # inside reads[4]: lands in a destination
    start = 6 * _BLOCK
    message = rf"f does not match its XXH3-64 .*bytes \[{start}, "
    reads = _reads(_SPANS)
    with pytest.raises(CheckpointError, match=message):
        _fill(tmp_path, reads, set(range(8)), digests, len(data))
    assert reads[-1].target[0] == data[reads[-1].offset]  # later reads still landed
    _fill(tmp_path, _reads(_SPANS), {0, 1, 2, 3, 4, 5, 7}, digests, len(data))  # 6 not asked
    _damage(tmp_path, data, 2200)  # between the first two reads: read from the file
    with pytest.raises(CheckpointError, match=r"bytes \[0, 4096\)"):
        _fill(tmp_path, _reads(_SPANS), {0}, digests, len(data))


def test_the_first_of_overlapping_reads_counts(tmp_path: Path) -> None:
    data, digests = _file(tmp_path)
    reads = _reads(_SPANS)
    _fill(tmp_path, reads, set(), digests, len(data))

    def check(indices: list[int]) -> None:
        checker = _landed.LandedBlocks(tmp_path / "f", reads, len(data), digests)
        try:
            checker.check(indices[:2])  # over two calls, as the fill hands them out
            checker.check(indices[2:])
        finally:
            checker.close()

    reads[3].target[0] ^= 0x01  # file byte 3 * _BLOCK, also held by reads[2], which starts first
    check(list(range(8)))
    reads[2].target[3 * _BLOCK - 5000] ^= 0x01  # the same file byte, in the read that counts
    with pytest.raises(CheckpointError, match=r"bytes \[12288,"):
        check(list(range(8)))


def test_a_block_past_the_digests_or_the_file_is_refused(tmp_path: Path) -> None:
    data, digests = _file(tmp_path)
    with pytest.raises(CheckpointError, match=r"bytes \[32768,"):
        _fill(tmp_path, [], {8}, digests, len(data))
    short = BlockDigests.xxh3(digests.digests[:3])
    with pytest.raises(CheckpointError, match=r"bytes \[12288,"):
        _fill(tmp_path, [], {3}, short, len(data))
