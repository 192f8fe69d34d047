"""Loads read and verify only the blocks they need; formats 1-2 still load (with SHA-256)."""

from __future__ import annotations

import hashlib
import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
import xxhash

from deepshard.checkpoint import ShardedTensor, load, load_state_dict_from_checkpoint, save, verify
from deepshard.checkpoint._block_read import BlockDigests, block_runs, read_regions, view_of
from deepshard.checkpoint._safetensors_io import BLOCK_BYTES
from deepshard.interface import ShardMap
from deepshard.interface.errors import CheckpointError, PartialLoadError

_ROWS = 3 * BLOCK_BYTES // (4 * 1024)  # a 1024-wide fp32 weight spanning three blocks


def _flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as handle:
        handle.seek(offset)
        byte = handle.read(1)
        handle.seek(offset)
        handle.write(bytes([byte[0] ^ 0xFF]))


def test_block_runs_group_consecutive_indices() -> None:
    assert block_runs({7, 0, 1, 2, 5}) == [(0, 2), (5, 5), (7, 7)]
    assert block_runs(set()) == []


def test_regions_are_read_once_and_checked_per_block(tmp_path: Path) -> None:
    data = bytes(range(256)) * (BLOCK_BYTES // 256 * 2 + 3)  # two blocks and a short third
    path = tmp_path / "f"
    path.write_bytes(data)
    blocks = BlockDigests.sha256(
        [
            hashlib.sha256(data[i : i + BLOCK_BYTES]).hexdigest()
            for i in range(0, len(data), BLOCK_BYTES)
        ]
    )
    with ThreadPoolExecutor(2) as pool:
        regions = read_regions(path, {0, 2}, len(data), blocks, pool)
        assert [(r.start, r.data.numel()) for r in regions] == [
            (0, BLOCK_BYTES),
            (2 * BLOCK_BYTES, len(data) - 2 * BLOCK_BYTES),
        ]
        tail = view_of(regions, len(data) - 8, len(data), torch.uint8, "f")
        assert bytes(tail.tolist()) == data[-8:]
        misaligned = view_of(regions, 1, 9, torch.float32, "f")  # not at a 4-byte offset
        assert (
            misaligned.tolist()
            == torch.frombuffer(bytearray(data[1:9]), dtype=torch.float32).tolist()
        )
        with pytest.raises(CheckpointError, match="were not read"):
            view_of(regions, BLOCK_BYTES, BLOCK_BYTES + 4, torch.uint8, "f")
        _flip(path, BLOCK_BYTES + 5)  # block 1 is not read: no error
        read_regions(path, {0, 2}, len(data), blocks, pool)
        with pytest.raises(
            CheckpointError, match=r"f does not match its SHA-256 .*bytes \[16777216,"
        ):
            read_regions(path, {1}, len(data), blocks, pool)


def _sharded_weight(rank: int) -> tuple[torch.Tensor, ShardedTensor]:
    full = torch.arange(_ROWS * 1024, dtype=torch.float32).view(_ROWS, 1024)
    smap = ShardMap.contiguous_split(tuple(full.shape), "float32", dim=0, sizes=[_ROWS // 3] * 3)
    return full, ShardedTensor(full[rank * _ROWS // 3 : (rank + 1) * _ROWS // 3], smap, rank=rank)


def test_a_sharded_load_reads_only_its_blocks(tmp_path: Path) -> None:
    full, _ = _sharded_weight(0)
    whole = ShardMap.contiguous_split(tuple(full.shape), "float32", dim=0, sizes=[_ROWS])
    save({"w": ShardedTensor(full, whole, rank=0)}, tmp_path, tag="t")
    (data_file,) = (tmp_path / "t").glob("*.safetensors")
    _flip(data_file, data_file.stat().st_size - 1)  # the last block: rows of shard 2 only
    _, first = _sharded_weight(0)
    target = {"w": ShardedTensor(torch.zeros_like(first.local), first.shard_map, rank=0)}
    result = load(tmp_path, target)  # shard 0 lies in the first block(s): still loads
    assert torch.equal(target["w"].local, first.local)
    assert result.bytes_read == first.local.numel() * 4
    _, last = _sharded_weight(2)
    target = {"w": ShardedTensor(torch.zeros_like(last.local), last.shard_map, rank=2)}
    with pytest.raises(CheckpointError, match=data_file.name):
        load(tmp_path, target, check_first=True)
    assert not target["w"].local.any()  # nothing was filled before the check failed
    with pytest.raises(PartialLoadError, match=data_file.name):
        load(tmp_path, target)


def test_loads_check_xxh3_and_verify_checks_both(tmp_path: Path) -> None:
    state = {"w": torch.randn(40, 7)}
    save(state, tmp_path, tag="t")
    meta_path = tmp_path / "t" / "metadata.json"
    saved = json.loads(meta_path.read_text())
    ((file, entry),) = saved["files"].items()
    data = (tmp_path / "t" / file).read_bytes()
    assert entry["block_xxh3"] == [xxhash.xxh3_64(data).hexdigest()]  # one block here
    # A SHA-256 list rewritten consistently (list and file digest): a load, which reads the
    # XXH3 list, still fills; `verify`, which checks both, names the file.
    forged = json.loads(meta_path.read_text())
    ((_, forged_entry),) = forged["files"].items()
    forged_entry["block_sha256"] = ["1" * 64]
    forged_entry["sha256"] = hashlib.sha256(("1" * 64).encode()).hexdigest()
    meta_path.write_text(json.dumps(forged))
    target = {"w": torch.zeros(40, 7)}
    load(tmp_path, target)
    assert torch.equal(target["w"], state["w"])
    assert any(file in p and "SHA-256" in p for p in verify(tmp_path).problems)
    # A wrong XXH3 digest fails the load, naming the file and the algorithm: before any fill
    # with check_first, else after the bytes landed.
    entry["block_xxh3"] = ["0" * 16]
    meta_path.write_text(json.dumps(saved))
    target = {"w": torch.zeros(40, 7)}
    with pytest.raises(CheckpointError, match=rf"{file} does not match its XXH3-64"):
        load(tmp_path, target, check_first=True)
    assert not target["w"].any()
    with pytest.raises(PartialLoadError, match=rf"{file} does not match its XXH3-64"):
        load(tmp_path, target)
    assert torch.equal(target["w"], state["w"])
    assert any(file in p and "XXH3-64" in p for p in verify(tmp_path).problems)


def _as_older_format(tag_dir: Path, version: int) -> None:
    """Rewrite a format-3 tag's metadata as an older format wrote it: format 2 had SHA-256 block
    digests only; format 1 one whole-file SHA-256 and no block lists."""
    meta_path = tag_dir / "metadata.json"
    meta = json.loads(meta_path.read_text())
    meta["format_version"] = version
    for file, entry in meta["files"].items():
        del entry["block_xxh3"]
        if version == 1:
            del entry["block_sha256"]
            entry["sha256"] = hashlib.sha256((tag_dir / file).read_bytes()).hexdigest()
    meta_path.write_text(json.dumps(meta))


@pytest.mark.parametrize("version", [1, 2])
def test_older_formats_load_and_verify_with_sha256(tmp_path: Path, version: int) -> None:
    state = {"w": torch.randn(40, 7), "b": torch.randn(3).to(torch.bfloat16)}
    save(state, tmp_path, tag="old")
    _as_older_format(tmp_path / "old", version)
    assert verify(tmp_path).ok
    target = {k: torch.zeros_like(v) for k, v in state.items()}
    load(tmp_path, target)
    assert all(torch.equal(target[k], state[k]) for k in state)
    full = load_state_dict_from_checkpoint(tmp_path)
    assert all(torch.equal(full[k], state[k]) for k in state)
    (data_file,) = (tmp_path / "old").glob("*.safetensors")
    _flip(data_file, data_file.stat().st_size - 2)
    assert data_file.name in " ".join(verify(tmp_path).problems)
    with pytest.raises(CheckpointError, match=rf"{data_file.name} does not match its SHA-256"):
        load(tmp_path, target)


def test_an_edited_block_list_is_refused(tmp_path: Path) -> None:
    state = {"w": torch.randn(40, 7)}
    save(state, tmp_path, tag="t")
    meta_path = tmp_path / "t" / "metadata.json"
    meta = json.loads(meta_path.read_text())
    (entry,) = meta["files"].values()
    entry["block_sha256"] = ["0" * 64]  # a list that no longer matches the file's digest
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match="block digests"):
        load(tmp_path, {"w": torch.zeros(40, 7)})
    assert not verify(tmp_path).ok
