"""The fast paths (aligned ``O_DIRECT`` writes, verify-then-read-into-place loads, prepared
host buffers) write, check and fill exactly the bytes the plain paths do."""

from __future__ import annotations

import errno
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
import xxhash

from deepshard.checkpoint import (
    ShardedTensor,
    _file_sink,
    load,
    load_state_dict_from_checkpoint,
    prepare_async_save,
    save,
)
from deepshard.checkpoint._block_read import BlockDigests, verify_blocks
from deepshard.checkpoint._file_sink import ALIGN, FileSink
from deepshard.checkpoint._hash_threads import HashThreads
from deepshard.checkpoint._safetensors_io import BLOCK_BYTES
from deepshard.interface import ShardMap
from deepshard.interface.errors import CheckpointError


def _sink_round_trip(path: Path, pieces: list[bytes], hashers: HashThreads | None) -> bool:
    consumed = bytearray()
    with FileSink(path, buffer_bytes=4 * ALIGN, consume=consumed.extend, hashers=hashers) as sink:
        for index, piece in enumerate(pieces):
            sink.write(piece)
            if index == 1:
                sink.push()  # what the mid-file save hook sees: a partial, aligned file
                assert path.stat().st_size == sink.size - sink.size % ALIGN
        assert sink.close() == sum(map(len, pieces))
    data = b"".join(pieces)
    assert path.read_bytes() == data
    assert bytes(consumed) == data  # every byte consumed once, in file order
    return sink.direct


@pytest.mark.parametrize("threaded", [False, True])
def test_file_sink_writes_and_consumes_every_byte_in_order(
    tmp_path: Path, threaded: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    pieces = [os.urandom(n) for n in (10, 3 * ALIGN + 7, 9 * ALIGN - 5, 1, ALIGN, 123)]
    hashers = HashThreads(2) if threaded else None
    try:
        _sink_round_trip(tmp_path / "direct", pieces, hashers)
        refused = []
        real_write = os.write

        def refuse_direct_once(fd: int, data: Any) -> int:
            if not refused:  # as a filesystem that takes O_DIRECT at open, not at write
                refused.append(fd)
                raise OSError(errno.EINVAL, "Invalid argument")
            return real_write(fd, data)

        monkeypatch.setattr(os, "write", refuse_direct_once)
        direct = _sink_round_trip(tmp_path / "refused", pieces, hashers)
        assert refused and not direct
        monkeypatch.setattr(_file_sink, "_DIRECT", 0)  # a system without O_DIRECT at all
        assert not _sink_round_trip(tmp_path / "buffered", pieces, hashers)
    finally:
        if hashers is not None:
            hashers.close()


def test_file_sink_refuses_an_unaligned_buffer(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="multiple of 4096"):
        FileSink(tmp_path / "f", buffer_bytes=ALIGN + 1, consume=lambda v: None, hashers=None)


def test_verify_blocks_checks_without_keeping(tmp_path: Path) -> None:
    data = os.urandom(3 * BLOCK_BYTES + 11)
    path = tmp_path / "f"
    path.write_bytes(data)
    # The load's digest (format 3), computed here with xxhash's own one-shot function.
    digests = BlockDigests.xxh3(
        [
            xxhash.xxh3_64(data[i : i + BLOCK_BYTES]).hexdigest()
            for i in range(0, len(data), BLOCK_BYTES)
        ]
    )
    with ThreadPoolExecutor(2) as pool:
        verify_blocks(path, {0, 1, 2, 3}, len(data), digests, pool)
        with open(path, "r+b") as handle:  # damage block 3, the short last one
            handle.seek(len(data) - 1)
            handle.write(bytes([data[-1] ^ 1]))
        verify_blocks(path, {0, 2}, len(data), digests, pool)  # not read: no error
        with pytest.raises(CheckpointError, match=r"match its XXH3-64 .*bytes \[50331648,"):
            verify_blocks(path, {1, 3}, len(data), digests, pool)
        with pytest.raises(CheckpointError, match="truncated"):
            verify_blocks(path, {3}, len(data) + BLOCK_BYTES, digests, pool)


def test_read_into_place_and_buffered_fills_agree(tmp_path: Path) -> None:
    weight = torch.randn(5, 9)
    smap = ShardMap.contiguous_split((5, 9), "float32", dim=0, sizes=[2, 3])
    whole = ShardMap.contiguous_split((5, 9), "float32", dim=0, sizes=[5])
    state: dict[str, torch.Tensor | ShardedTensor] = {"w": ShardedTensor(weight, whole, 0)}
    state["odd"] = torch.arange(7, dtype=torch.int8)  # puts the next entry at an odd offset
    state["b"] = torch.randn(13).to(torch.bfloat16)
    save(state, tmp_path, tag="t")
    into_place = {
        "w": ShardedTensor(torch.zeros(3, 9), smap, 1),  # resharded, read straight in
        "odd": torch.zeros(7, dtype=torch.int8),
        "b": torch.zeros(13, dtype=torch.bfloat16),
    }
    result = load(tmp_path, into_place)
    assert torch.equal(into_place["w"].local, weight[2:])
    assert torch.equal(into_place["b"], state["b"])
    assert result.bytes_read == 3 * 9 * 4 + 7 + 13 * 2
    scaled = ShardMap.replicated((5, 9), "float32", ranks=[0], scale=0.5)
    buffered = {  # a scale and a dtype cast go through host buffers
        "w": ShardedTensor(torch.zeros(5, 9), scaled, 0),
        "odd": torch.zeros(7, dtype=torch.int8),
        "b": torch.zeros(13, dtype=torch.float32),
    }
    load(tmp_path, buffered)
    assert torch.equal(buffered["w"].local, weight * 0.5)
    assert torch.equal(buffered["b"], state["b"].float())
    full = load_state_dict_from_checkpoint(tmp_path)
    assert torch.equal(full["w"], weight) and torch.equal(full["odd"], state["odd"])


def test_a_prepared_first_background_save_copies_into_the_prepared_buffers(
    tmp_path: Path,
) -> None:
    state = {"w": torch.randn(64, 33), "step": torch.tensor(3)}
    prepared = prepare_async_save(state)
    assert prepared.wait(timeout_s=60) == Path()
    pointers = {k: b.data_ptr() for k, b in prepared._host_buffers.items()}
    saved = state["w"].clone()
    handle = save(state, tmp_path, tag="a", async_save=True, after=prepared)
    assert {k: b.data_ptr() for k, b in handle._host_buffers.items()} == pointers
    state["w"].add_(1.0)  # training goes on: the snapshot keeps the values at save time
    handle.wait()
    target = {k: torch.zeros_like(v) for k, v in state.items()}
    load(tmp_path, target, tag="a")
    assert torch.equal(target["w"], saved) and int(target["step"]) == 3
    other = prepare_async_save({"w": torch.zeros(2), "step": torch.tensor(0)})  # "w" changed
    step_buffer = other.wait() and other._host_buffers["step"].data_ptr()
    again = save(state, tmp_path, tag="b", async_save=True, after=other)
    assert again._host_buffers["step"].data_ptr() == step_buffer
    assert again.wait() == tmp_path / "b"  # a fresh buffer for "w", same result
    load(tmp_path, target, tag="b")
    assert torch.equal(target["w"], state["w"])
