"""`save_resharded` writes from one process the files a 2-rank save would write; each rank's
view of it loads, and it round-trips through `load_state_dict_from_checkpoint`."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from deepshard.checkpoint import (
    ShardedTensor,
    load,
    load_state_dict_from_checkpoint,
    save_resharded,
    verify,
)
from deepshard.interface import ShardMap
from deepshard.interface.errors import CheckpointError


def test_offline_two_rank_layout(tmp_path: Path) -> None:
    gen = torch.Generator().manual_seed(5)
    full = {"a": torch.randn(5, 7, generator=gen), "b": torch.randn(3, generator=gen)}
    (a_map,) = ShardMap.flat_buffer([(5, 7)], "float32", world_size=2, alignment=4)
    path = save_resharded(full, {"a": a_map}, tmp_path, tag="dp2", world_size=2, metadata={"x": 1})
    assert sorted(p.name for p in path.glob("*.safetensors")) == [
        "rank-00000-of-00002.safetensors",
        "rank-00001-of-00002.safetensors",
    ]
    assert verify(tmp_path).ok
    back = load_state_dict_from_checkpoint(tmp_path)
    assert torch.equal(back["a"], full["a"]) and torch.equal(back["b"], full["b"])
    flat = full["a"].reshape(-1)
    for rank, (start, stop) in enumerate([(0, 18), (18, 35)]):  # partitions of 18 (36 / 2)
        mine = torch.zeros(18)
        result = load(tmp_path, {"a": ShardedTensor(mine, a_map, rank)}, strict=False)
        assert torch.equal(mine[: stop - start], flat[start:stop])
        assert result.bytes_read == (stop - start) * 4  # one rank's file, nothing else


def test_offline_refuses_unknown_maps(tmp_path: Path) -> None:
    smap = ShardMap.contiguous_split((2,), "float32", dim=0, sizes=[1, 1])
    with pytest.raises(CheckpointError, match=r"lacks: \['z'\]"):
        save_resharded({}, {"z": smap}, tmp_path, tag="t", world_size=2)
