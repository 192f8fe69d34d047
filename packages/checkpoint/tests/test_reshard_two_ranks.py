"""Two gloo ranks save a ZeRO-like flat layout (also in background: the same files); it loads
at world 2 in other layouts and at world 1, replicated and sharded swap, and a rank failing
mid-save (or passing another tag) fails the save on both ranks.

The full tensors are made from a seed in the test; each rank's expected storage is cut from
them with plain slicing of the partitioned buffer (not with the shard-map arithmetic).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from deepshard.checkpoint import (
    ShardedTensor,
    list_tags,
    load,
    load_state_dict_from_checkpoint,
    read_metadata,
    save,
)
from deepshard.interface import ShardMap
from deepshard.interface.errors import CheckpointError
from deepshard.testing import run_on_mesh

SHAPES = {"a": (5, 7), "b": (3, 4)}  # 35 + 12 elements; alignment 4 -> 36 + 12 = 48, 2 x 24
ALIGN = 4


def _full() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    return {name: torch.randn(shape, generator=gen) for name, shape in SHAPES.items()}


def _partition(full: dict[str, torch.Tensor], rank: int, world: int) -> torch.Tensor:
    """The flat ZeRO buffer (each tensor padded to ALIGN elements), cut into equal partitions."""
    parts = []
    for tensor in full.values():
        flat = tensor.reshape(-1)
        parts += [flat, torch.zeros(-flat.numel() % ALIGN)]
    buffer = torch.cat(parts)
    size = -(-buffer.numel() // world)
    buffer = torch.cat([buffer, torch.zeros(size * world - buffer.numel())])
    return buffer[rank * size : (rank + 1) * size].clone()


def _zero_state(full: dict[str, torch.Tensor], rank: int, world: int) -> dict[str, Any]:
    maps = ShardMap.flat_buffer(list(SHAPES.values()), "float32", world_size=world, alignment=ALIGN)
    masters = _partition(full, rank, world)
    moments = _partition({k: v * v for k, v in full.items()}, rank, world)
    state: dict[str, Any] = {}
    for (name, _), smap in zip(SHAPES.items(), maps, strict=True):
        state[f"{name}.master"] = ShardedTensor(masters, smap, rank)
        state[f"{name}.exp_avg_sq"] = ShardedTensor(moments, smap, rank, linear=False)
    state["step"] = torch.tensor(5)
    return state


class _FailAt:
    def __init__(self, point: str, rank: int) -> None:
        self.point, self.rank = point, rank

    def reached(self, point: str, rank: int) -> None:
        if (point, rank) == (self.point, self.rank):
            raise OSError(f"injected failure at {point}")


def _ranks(mesh: Any, root: Path) -> dict[str, Any]:
    group, rank = mesh["dp"], mesh.get_rank()
    full = _full()
    save(_zero_state(full, rank, 2), root, tag="w2", group=group, metadata={"world": 2})
    pending = save(
        _zero_state(full, rank, 2), root / "async", tag="w2", group=group, async_save=True
    )
    pending.wait()
    out: dict[str, Any] = {}
    # World 2, other layouts: `a` split on dim 1 unevenly, `b` replicated on both ranks.
    columns = ShardMap.contiguous_split((5, 7), "float32", dim=1, sizes=[3, 4])
    a_local = torch.zeros(5 * (3 if rank == 0 else 4))
    b_whole = torch.zeros(3, 4)
    step = torch.tensor(0)
    result = load(
        root,
        {"a.master": ShardedTensor(a_local, columns, rank), "b.master": b_whole, "step": step},
        group=group,
        strict=False,
    )
    out.update(a=a_local, b=b_whole, step=step, unexpected=result.unexpected)
    # The saved layout again: each rank reads exactly its own partition's bytes.
    same = _zero_state({k: torch.zeros_like(v) for k, v in full.items()}, rank, 2)
    out["same"] = load(root, same, group=group).bytes_read
    out["same_masters"] = same["a.master"].local
    # Replicated -> sharded: save `b` whole from both ranks, load it as 2 row shards.
    save({"b": full["b"]}, root / "rep", tag="t", group=group)
    rows = ShardMap.contiguous_split((3, 4), "float32", dim=0, sizes=[2, 1])
    mine = torch.zeros(8 if rank == 0 else 4)
    load(root / "rep", {"b": ShardedTensor(mine, rows, rank)}, group=group)
    out["b_rows"] = mine
    # A rank failing mid-save fails the save on every rank, promptly, and `latest` survives.
    try:
        save({"b": full["b"]}, root, tag="broken", group=group, hooks=_FailAt("mid_file", 1))
    except CheckpointError as exc:
        out["failure"] = str(exc)
    try:
        save({"b": full["b"]}, root, tag=f"step{rank}", group=group)
    except CheckpointError as exc:
        out["tags"] = str(exc)
    return out


def test_two_ranks_reshard_and_fail_together(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    results = run_on_mesh(_ranks, 2, args=(root,), store_dir=tmp_path, timeout_s=60)
    full = _full()
    for rank, out in enumerate(results):
        cols = slice(0, 3) if rank == 0 else slice(3, 7)
        assert torch.equal(out["a"].view(5, -1), full["a"][:, cols])
        assert torch.equal(out["b"], full["b"]) and int(out["step"]) == 5
        assert set(out["unexpected"]) == {"a.exp_avg_sq", "b.exp_avg_sq"}
        rows = slice(0, 2) if rank == 0 else slice(2, 3)
        assert torch.equal(out["b_rows"], full["b"][rows].reshape(-1))
        assert "rank 1" in out["failure"] and "injected failure at mid_file" in out["failure"]
        assert "different tags ['step0', 'step1']" in out["tags"]
        assert torch.equal(out["same_masters"], _partition(full, rank, 2))
        held = {0: 24 + 24, 1: (35 - 24) + 12 + (35 - 24) + 12}[rank]  # masters + moments
        assert out["same"] == held * 4 + 8  # + the int64 `step`, which every rank reads whole
    assert list_tags(root) == ["w2"] and (root / "latest").read_text().strip() == "w2"
    assert not list(root.glob(".tmp-*"))  # failed saves leave nothing behind
    assert read_metadata(root)["metadata"] == {"world": 2}
    for name in ("rank-00000-of-00002.safetensors", "rank-00001-of-00002.safetensors"):
        assert (root / "async" / "w2" / name).read_bytes() == (root / "w2" / name).read_bytes()

    # World 1: consolidated, and into a one-rank ZeRO layout with another alignment.
    whole = load_state_dict_from_checkpoint(root)
    assert torch.equal(whole["a.master"], full["a"]) and torch.equal(whole["b.master"], full["b"])
    assert torch.equal(whole["a.exp_avg_sq"], full["a"] * full["a"])
    maps = ShardMap.flat_buffer(list(SHAPES.values()), "float32", world_size=1, alignment=16)
    buffer = torch.zeros(48 + 16)
    like = {f"{n}.master": ShardedTensor(buffer, m, 0) for n, m in zip(SHAPES, maps, strict=True)}
    load(root, like, strict=False)
    assert torch.equal(buffer[:35], full["a"].reshape(-1))
    assert torch.equal(buffer[48:60], full["b"].reshape(-1))


def test_optimizer_state_into_a_scaled_piece_is_refused(tmp_path: Path) -> None:
    full = _full()
    save(_zero_state(full, 0, 1), tmp_path, tag="t")
    scaled = ShardMap.replicated((3, 4), "float32", ranks=[0], scale=0.5)
    params = torch.zeros(12)
    load(tmp_path, {"b.master": ShardedTensor(params, scaled, 0)}, strict=False)
    assert torch.equal(params, full["b"].reshape(-1) * 0.5)
    with pytest.raises(CheckpointError, match=r"optimizer state saved with scale 1\.0"):
        load(
            tmp_path,
            {"b.exp_avg_sq": ShardedTensor(torch.zeros(12), scaled, 0, linear=False)},
            strict=False,
        )
