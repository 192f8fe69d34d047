"""A damaged block in the middle of a file is caught by the parallel check, before any fill."""

from __future__ import annotations

import hashlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from deepshard.checkpoint import load, load_state_dict_from_checkpoint, save, verify
from deepshard.checkpoint._block_read import BlockDigests, verify_blocks
from deepshard.checkpoint._safetensors_io import BLOCK_BYTES
from deepshard.interface.errors import CheckpointError, PartialLoadError

_ELEMENTS = 5 * BLOCK_BYTES // 8  # 2.5 blocks of fp32


def _flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as handle:
        handle.seek(offset)
        byte = handle.read(1)
        handle.seek(offset)
        handle.write(bytes([byte[0] ^ 0x01]))


def _saved(tmp_path: Path) -> tuple[torch.Tensor, Path]:
    weight = torch.randn(_ELEMENTS, generator=torch.Generator().manual_seed(3))
    save({"w": weight}, tmp_path, tag="t")
    (data_file,) = (tmp_path / "t").glob("*.safetensors")
    return weight, data_file


def test_every_block_is_checked_on_many_threads(tmp_path: Path) -> None:
    data = bytes(range(251)) * (5 * BLOCK_BYTES // 251)
    path = tmp_path / "f"
    path.write_bytes(data)
    digests = BlockDigests.sha256(
        [
            hashlib.sha256(data[i : i + BLOCK_BYTES]).hexdigest()
            for i in range(0, len(data), BLOCK_BYTES)
        ]
    )
    with ThreadPoolExecutor(4) as pool:
        verify_blocks(path, set(range(5)), len(data), digests, pool)
        _flip(path, 2 * BLOCK_BYTES + 12345)  # block 2 of 5, hashed while others are
        verify_blocks(path, {0, 1, 3, 4}, len(data), digests, pool)
        with pytest.raises(
            CheckpointError, match=rf"f does not match .*bytes \[{2 * BLOCK_BYTES},"
        ):
            verify_blocks(path, set(range(5)), len(data), digests, pool)
        with pytest.raises(CheckpointError, match="f does not match"):
            short = BlockDigests.sha256(digests.digests[:2])  # no digest for block 2
            verify_blocks(path, {0, 1, 2}, len(data), short, pool)


def test_a_middle_block_damaged_fails_the_load(tmp_path: Path) -> None:
    weight, data_file = _saved(tmp_path)
    like = {"w": torch.full_like(weight, 7.0)}
    assert load(tmp_path, like).bytes_read == weight.numel() * 4
    assert torch.equal(like["w"], weight)
    _flip(data_file, BLOCK_BYTES + 999)  # the middle block
    target = {"w": torch.full_like(weight, 7.0)}
    named = rf"{data_file.name} does not match its XXH3-64 in the metadata \(bytes \[16777216,"
    with pytest.raises(CheckpointError, match=named):
        load(tmp_path, target, check_first=True)
    assert bool((target["w"] == 7.0).all()), "bytes reached the target before the check"
    with pytest.raises(PartialLoadError, match=rf"{named}.*partly overwritten"):
        load(tmp_path, target)  # checked where the bytes landed
    assert torch.equal(target["w"][: BLOCK_BYTES // 4], weight[: BLOCK_BYTES // 4])
    with pytest.raises(CheckpointError, match=rf"{data_file.name} does not match"):
        load_state_dict_from_checkpoint(tmp_path)
    report = verify(tmp_path)
    assert not report.ok and data_file.name in report.problems[0]
    unchecked = {"w": torch.zeros_like(weight)}  # unchecked: the flipped byte comes through
    load(tmp_path, unchecked, verify_checksums=False)
    assert not torch.equal(unchecked["w"], weight)
    assert torch.equal(unchecked["w"][: BLOCK_BYTES // 4], weight[: BLOCK_BYTES // 4])
