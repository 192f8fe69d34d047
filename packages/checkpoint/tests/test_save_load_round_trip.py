"""One process: a save loads back bit-exactly, into other layouts, and bad requests are refused."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
import xxhash
from safetensors.torch import load_file

from deepshard.checkpoint import (
    ShardedTensor,
    list_tags,
    load,
    load_state_dict_from_checkpoint,
    read_metadata,
    save,
    verify,
)
from deepshard.interface import ShardMap
from deepshard.interface.errors import CheckpointError


def _state() -> dict[str, torch.Tensor | ShardedTensor]:
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(5, 3, generator=gen)
    whole = ShardMap.contiguous_split((5, 3), "float32", dim=0, sizes=[5])
    return {
        "weight": ShardedTensor(weight, whole, rank=0),
        "bias": torch.randn(3, generator=gen).to(torch.bfloat16),
        "step": torch.tensor(11, dtype=torch.int64),
        "mask": torch.tensor([True, False, True]),
    }


def _zeros_like(state: dict[str, torch.Tensor | ShardedTensor]) -> dict[str, torch.Tensor]:
    return {
        k: torch.zeros_like(v.local if isinstance(v, ShardedTensor) else v)
        for k, v in state.items()
    }


def test_round_trip_is_bit_exact(tmp_path: Path) -> None:
    state = _state()
    handle = save(state, tmp_path, tag="step11", metadata={"lr": 0.5, "names": ["a"]})
    assert handle.done() and handle.wait() == tmp_path / "step11"
    target = _zeros_like(state)
    result = load(tmp_path, target)
    assert result.path == tmp_path / "step11" and result.metadata == {"lr": 0.5, "names": ["a"]}
    assert result.missing == () and result.unexpected == ()
    for name, value in state.items():
        expected = value.local if isinstance(value, ShardedTensor) else value
        assert target[name].dtype == expected.dtype
        assert torch.equal(target[name], expected), name
    full = load_state_dict_from_checkpoint(tmp_path / "step11")
    assert torch.equal(full["weight"], state["weight"].local)  # type: ignore[union-attr]


def test_files_are_standard_safetensors_and_metadata_is_complete(tmp_path: Path) -> None:
    state = _state()
    save(state, tmp_path, tag="t", metadata={"step": 11})
    (data_file,) = sorted((tmp_path / "t").glob("*.safetensors"))
    plain = load_file(data_file)
    assert torch.equal(plain["bias"], state["bias"])  # type: ignore[arg-type]
    meta = json.loads((tmp_path / "t" / "metadata.json").read_text())
    assert meta == read_metadata(tmp_path)
    assert meta["format_version"] == 3 and meta["metadata"] == {"step": 11}
    assert meta["versions"]["torch"] == torch.__version__
    assert meta["files"][data_file.name]["size"] == data_file.stat().st_size
    # Formats 2-3: one SHA-256 per 16 MiB block (one here), the file's digest is that of the
    # list; format 3 adds each block's XXH3-64, what a load checks.
    block = hashlib.sha256(data_file.read_bytes()).hexdigest()
    assert meta["files"][data_file.name]["block_sha256"] == [block]
    fast = xxhash.xxh3_64(data_file.read_bytes()).hexdigest()
    assert meta["files"][data_file.name]["block_xxh3"] == [fast]
    assert meta["files"][data_file.name]["sha256"] == hashlib.sha256(block.encode()).hexdigest()
    weight_map = ShardMap.from_json(meta["tensors"]["weight"]["shard_map"])
    assert weight_map.global_shape == (5, 3) and weight_map.dtype == "float32"
    assert sorted(p.name for p in (tmp_path / "t").iterdir()) == ["metadata.json", data_file.name]


def test_loads_into_another_layout_in_place(tmp_path: Path) -> None:
    state = _state()
    save(state, tmp_path, tag="t")
    weight = state["weight"].local  # type: ignore[union-attr]
    # Rank 1 of a column split holds columns 1-2, stored after two unused elements.
    columns = ShardMap.contiguous_split((5, 3), "float32", dim=1, sizes=[1, 2])
    columns = ShardMap(
        (5, 3), "float32", tuple(p if p.rank == 0 else _shift(p, 2) for p in columns.pieces)
    )
    live = torch.full((12,), -1.0)
    view = live[:]  # a view of live storage: load must write through it
    load(tmp_path, {"weight": ShardedTensor(view, columns, rank=1)}, strict=False)
    assert torch.equal(live[:2], torch.tensor([-1.0, -1.0]))
    assert torch.equal(live[2:].view(5, 2), weight[:, 1:])


def _shift(piece, by):  # type: ignore[no-untyped-def]
    from dataclasses import replace

    return replace(piece, local_offset=piece.local_offset + by)


def test_sharded_save_loads_replicated_and_back(tmp_path: Path) -> None:
    full = torch.arange(20.0).reshape(4, 5)
    flat = full.reshape(-1)
    maps = ShardMap.flat_buffer([(4, 5)], "float32", world_size=1)
    save({"w": ShardedTensor(flat.clone(), maps[0], 0)}, tmp_path / "a", tag="t")
    replicated = torch.zeros(4, 5)
    load(tmp_path / "a", {"w": replicated})
    assert torch.equal(replicated, full)
    save({"w": full}, tmp_path / "b", tag="t")
    rows = ShardMap.contiguous_split((4, 5), "float32", dim=0, sizes=[1, 3])
    mine = ShardedTensor(torch.zeros(15), rows, rank=1)
    load(tmp_path / "b", {"w": mine})
    assert torch.equal(mine.local, flat[5:])


def test_latest_tags_and_missing_latest(tmp_path: Path) -> None:
    state = {"x": torch.ones(2)}
    save(state, tmp_path, tag="first")
    save({"x": torch.full((2,), 2.0)}, tmp_path, tag="second", save_latest=False)
    assert list_tags(tmp_path) == ["first", "second"]
    target = {"x": torch.zeros(2)}
    assert load(tmp_path, target).path.name == "first" and torch.equal(target["x"], state["x"])
    assert load(tmp_path, target, tag="second").path.name == "second"
    (tmp_path / "latest").unlink()
    with pytest.raises(CheckpointError, match=r"no 'latest'.*\['first', 'second'\]"):
        load(tmp_path, target)
    with pytest.raises(CheckpointError, match=r"'third' is not in .*tags present"):
        load(tmp_path, target, tag="third")


def test_mismatched_keys_and_shapes_are_refused(tmp_path: Path) -> None:
    save({"x": torch.ones(2), "y": torch.ones(3)}, tmp_path, tag="t")
    with pytest.raises(CheckpointError, match=r"missing from the checkpoint \['z'\].*\['y'\]"):
        load(tmp_path, {"x": torch.zeros(2), "z": torch.zeros(1)})
    result = load(tmp_path, {"x": torch.zeros(2), "z": torch.zeros(1)}, strict=False)
    assert result.missing == ("z",) and result.unexpected == ("y",)
    with pytest.raises(CheckpointError, match=r"x: the checkpoint holds shape \(2,\)"):
        load(tmp_path, {"x": torch.zeros(3)}, strict=False)
    with pytest.raises(CheckpointError, match="not contiguous"):
        load(tmp_path, {"x": torch.zeros(2, 2)[:, 0]}, strict=False)


def test_bad_arguments_are_refused(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"tag '\.\./up'"):
        save({"x": torch.ones(1)}, tmp_path, tag="../up")
    with pytest.raises(CheckpointError, match=r"x: a checkpoint holds torch\.Tensor"):
        save({"x": [1.0]}, tmp_path, tag="t")  # type: ignore[dict-item]
    with pytest.raises(CheckpointError, match="JSON-serialisable"):
        save({"x": torch.ones(1)}, tmp_path, tag="t", metadata={"f": object()})
    smap = ShardMap.contiguous_split((4,), "float32", dim=0, sizes=[4])
    with pytest.raises(CheckpointError, match="need 4"):
        save({"x": ShardedTensor(torch.ones(3), smap, 0)}, tmp_path, tag="t")
    with pytest.raises(CheckpointError, match="says float32"):
        save({"x": ShardedTensor(torch.ones(4, dtype=torch.float64), smap, 0)}, tmp_path, tag="t")
    half = ShardMap.contiguous_split((4,), "float32", dim=0, sizes=[2, 2])
    with pytest.raises(CheckpointError, match="do not cover the tensor once"):
        save({"x": ShardedTensor(torch.ones(2), half, 0)}, tmp_path, tag="t")
    assert list_tags(tmp_path) == []


def test_module_parameters_load_in_place(tmp_path: Path) -> None:
    torch.manual_seed(0)
    source, fresh = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)
    save(dict(source.named_parameters()), tmp_path, tag="t")
    weight = fresh.weight
    load(tmp_path, dict(fresh.named_parameters()))
    assert fresh.weight is weight and weight.requires_grad and weight.grad_fn is None
    pairs = zip(source.parameters(), fresh.parameters(), strict=True)
    assert all(torch.equal(a, b) for a, b in pairs)


def test_size_bounded_files(tmp_path: Path) -> None:
    state = {f"t{i}": torch.full((100,), float(i)) for i in range(5)}  # 400 bytes each
    state["big"] = torch.arange(300.0)  # 1200 bytes: alone in its file
    save(state, tmp_path, tag="t", max_file_bytes=900)
    files = sorted(p.name for p in (tmp_path / "t").glob("*.safetensors"))
    assert files == [f"rank-00000-of-00001-part-{i:05d}.safetensors" for i in range(4)]
    meta = read_metadata(tmp_path)
    assert meta["tensors"]["big"]["files"] == {"0": files[3]}
    assert {meta["tensors"][f"t{i}"]["files"]["0"] for i in (0, 1)} == {files[0]}
    target = {k: torch.zeros_like(v) for k, v in state.items()}
    load(tmp_path, target)
    assert all(torch.equal(target[k], state[k]) for k in state)
    assert verify(tmp_path).ok
    with pytest.raises(CheckpointError, match="max_file_bytes=0"):
        save(state, tmp_path, tag="u", max_file_bytes=0)
