"""``ds-checkpoint inspect``, ``verify`` and ``reshard`` on a checkpoint two gloo ranks saved.

The source is an engine-style state (``module/<name>`` fp32 weights and
``optimizer/<name>/exp_avg`` sharded as ZeRO stages 1-2 lay them out over 2 ranks, a replicated
step). ``inspect --json`` must list every tensor's shape, dtype and byte size; ``verify``
passes, then fails naming the file after one byte of it is flipped; ``reshard --dp 3 --stage 3``
writes 3 ranks' files whose pieces are each tensor's ``ceil(numel / 3)`` slices (computed
here by plain arithmetic) and whose consolidated tensors equal the source.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from deepshard.checkpoint import ShardedTensor, load_state_dict_from_checkpoint, read_metadata, save
from deepshard.checkpoint.cli import main
from deepshard.interface import ShardMap
from deepshard.testing import run_on_mesh

SHAPES = {"embed.weight": (7, 5), "head.bias": (3,)}


def _full() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(11)
    out = {}
    for name, shape in SHAPES.items():
        out[f"module/{name}"] = torch.randn(shape, generator=gen)
        out[f"optimizer/{name}/exp_avg"] = torch.randn(shape, generator=gen)
    out["optimizer/param_groups.0/step"] = torch.tensor(4.0)
    return out


def _save_two_ranks(mesh: Any, root: Path) -> None:
    rank = mesh.get_rank()
    full = _full()
    maps = ShardMap.flat_buffer(list(SHAPES.values()), "float32", world_size=2)
    state: dict[str, Any] = {"optimizer/param_groups.0/step": full["optimizer/param_groups.0/step"]}
    for prefix, suffix, linear in (("module/", "", True), ("optimizer/", "/exp_avg", False)):
        flat = torch.cat([full[f"{prefix}{n}{suffix}"].reshape(-1) for n in SHAPES])
        half = math.ceil(flat.numel() / 2)
        local = flat[rank * half : (rank + 1) * half].clone()
        for name, smap in zip(SHAPES, maps, strict=True):
            state[f"{prefix}{name}{suffix}"] = ShardedTensor(local, smap, rank, linear=linear)
    save(state, root, tag="global_step4", group=mesh["dp"], metadata={"engine": {"step": 4}})


@pytest.fixture
def saved(tmp_path: Path) -> Path:
    root = tmp_path / "ckpt"
    run_on_mesh(_save_two_ranks, 2, args=(root,), store_dir=tmp_path, timeout_s=120)
    return root


def test_inspect_lists_every_tensor(saved: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", str(saved), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["tag"] == "global_step4" and summary["world_size"] == 2
    full = _full()
    rows = {t["name"]: t for t in summary["tensors"]}
    assert sorted(rows) == sorted(full)
    for name, tensor in full.items():
        assert rows[name]["shape"] == list(tensor.shape) and rows[name]["dtype"] == "float32"
        assert rows[name]["bytes"] == tensor.numel() * 4
    assert rows["module/embed.weight"]["ranks"] == [0, 1]
    assert summary["total_bytes"] == sum(t.numel() * 4 for t in full.values())
    assert main(["inspect", str(saved)]) == 0
    table = capsys.readouterr().out
    assert "global_step4" in table and "optimizer/head.bias/exp_avg" in table and "7x5" in table


def test_verify_passes_then_names_the_flipped_file(
    saved: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["verify", str(saved)]) == 0
    assert "OK" in capsys.readouterr().out
    victim = saved / "global_step4" / "rank-00001-of-00002.safetensors"
    data = bytearray(victim.read_bytes())
    data[-3] ^= 0x01
    victim.write_bytes(bytes(data))
    assert main(["verify", str(saved)]) == 1
    assert "rank-00001-of-00002.safetensors" in capsys.readouterr().err


def test_reshard_to_three_ranks_at_stage_3(saved: Path, tmp_path: Path) -> None:
    out = tmp_path / "dp3"
    assert main(["reshard", str(saved), str(out), "--dp", "3", "--stage", "3"]) == 0
    meta = read_metadata(out)
    assert meta["world_size"] == 3 and meta["metadata"] == {"engine": {"step": 4}}
    assert sorted(meta["files"]) == [f"rank-0000{r}-of-00003.safetensors" for r in range(3)]
    for name, tensor in _full().items():
        pieces = meta["tensors"][name]["shard_map"]["pieces"]
        if tensor.dim() == 0:
            continue
        width = -(-tensor.numel() // 3)
        expected = [
            (r, r * width, min(tensor.numel(), (r + 1) * width))
            for r in range(3)
            if r * width < tensor.numel()
        ]
        assert sorted((p["rank"], p["flat_start"], p["flat_stop"]) for p in pieces) == expected
    whole = load_state_dict_from_checkpoint(out)
    full = _full()
    assert sorted(whole) == sorted(full)
    assert all(torch.equal(whole[k], full[k]) for k in full)
    assert main(["verify", str(out)]) == 0


def test_reshard_refuses_a_bad_stage(saved: Path, tmp_path: Path) -> None:
    from deepshard.checkpoint._convert import reshard
    from deepshard.interface.errors import CheckpointError

    with pytest.raises(CheckpointError, match="--stage 5"):
        reshard(saved, tmp_path / "x", dp=2, stage=5)
