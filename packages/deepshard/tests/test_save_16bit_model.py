"""``engine.save_16bit_model`` writes the trained weights as safetensors, from rank 0 only.

On 2 gloo ranks, for ZeRO stages 0-3 (stage 3 gathers the partitions) with a bf16 model
after two optimizer steps:

* each rank passes its own directory, and only rank 0's gets a file: DeepSpeed's default name
  ``pytorch_model.bin`` becomes ``model.safetensors``; every rank gets that path back; at
  stages 0-2 rank 0 may also call it alone (the other rank goes on to a collective, which
  completes: nothing inside the save waits for it), and no temporary file is left;
* the file holds exactly the module's state dict on every rank (bf16, bit for bit), with the
  ``format: pt`` metadata Hugging Face's loaders check; a tied parameter is stored under both
  names and the file loads into a fresh model with ``load_state_dict(strict=True)``;
* ``exclude_frozen_parameters`` leaves out the frozen layer; ``weights.pt`` is written as
  ``weights.safetensors``; ``model.json`` is refused on every rank, naming the rule.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from deepshard.testing import run_on_mesh

STAGES = (0, 1, 2, 3)


class _Tied(torch.nn.Module):
    """An embedding whose weight the output head shares, plus a layer to freeze."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(11, 6)
        self.frozen = torch.nn.Linear(6, 6)
        self.head = torch.nn.Linear(6, 11, bias=False)
        self.head.weight = self.embed.weight
        self.frozen.requires_grad_(False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.frozen(self.embed(ids))))


def _save(mesh: Any, stage: int, root: str) -> dict[str, Any]:
    import deepshard.engine as ds

    rank = mesh.get_rank()
    config = {
        "train_batch_size": 4,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": stage},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
    }
    model = _Tied()
    engine, _, _, _ = ds.initialize(model=model, config=config, mesh=mesh)
    for step in range(2):
        ids = torch.randint(0, 11, (2, 5), generator=torch.Generator().manual_seed(step + rank))
        engine.backward(engine(ids).float().logsumexp(-1).mean())
        engine.step()
    mine = Path(root) / f"stage{stage}" / f"rank{rank}"
    written = engine.save_16bit_model(mine)
    renamed = engine.save_16bit_model(mine / "sub", "weights.pt", exclude_frozen_parameters=True)
    refused = ""
    try:
        engine.save_16bit_model(mine, "model.json")
    except ds.ConfigError as error:
        refused = str(error)
    if stage < 3 and rank == 0:  # DeepSpeed scripts' `if rank == 0: save_16bit_model(...)`
        engine.save_16bit_model(mine / "solo")
    total = torch.tensor([float(rank + 1)])
    torch.distributed.all_reduce(total)  # rank 0 is not left waiting inside the save
    state = engine.module_state_dict()  # whole tensors (gathered at stage 3)
    return {
        "written": str(written),
        "renamed": str(renamed),
        "refused": refused,
        "state": state,
        "total": total.item(),
    }


def _save_each_stage(mesh: Any, root: str) -> list[dict[str, Any]]:
    return [_save(mesh, stage, root) for stage in STAGES]


@pytest.fixture(scope="module")
def saved_runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Any]]:
    """One 2-rank run saves at the three stages (each run costs seconds of process start-up)."""
    root = tmp_path_factory.mktemp("save_16bit")
    return root, run_on_mesh(_save_each_stage, 2, args=(str(root),), timeout_s=180)


@pytest.mark.parametrize("stage", STAGES)
def test_rank_0_writes_the_module_state_as_safetensors(
    saved_runs: tuple[Path, list[Any]], stage: int
) -> None:
    root, runs = saved_runs
    results = [by_rank[STAGES.index(stage)] for by_rank in runs]
    base = root / f"stage{stage}"
    solo = ["rank0/solo/model.safetensors"] if stage < 3 else []
    assert sorted(p.relative_to(base).as_posix() for p in base.rglob("*") if p.is_file()) == [
        "rank0/model.safetensors",
        *solo,
        "rank0/sub/weights.safetensors",
    ]
    assert [r["total"] for r in results] == [3.0, 3.0]
    if solo:
        assert (
            load_file(base / solo[0]).keys() == load_file(base / "rank0/model.safetensors").keys()
        )
    saved = load_file(base / "rank0" / "model.safetensors")
    with safe_open(base / "rank0" / "model.safetensors", framework="pt") as handle:
        assert handle.metadata() == {"format": "pt"}
    reference = results[0]["state"]
    assert (
        set(saved)
        == set(reference)
        == {
            "embed.weight",
            "frozen.weight",
            "frozen.bias",
            "head.weight",
        }
    )
    for rank, got in enumerate(results):
        assert got["written"] == str(base / f"rank{rank}" / "model.safetensors")
        assert got["renamed"] == str(base / f"rank{rank}" / "sub" / "weights.safetensors")
        assert "name the file *.safetensors" in got["refused"]
        for name, tensor in got["state"].items():
            assert saved[name].dtype == torch.bfloat16
            assert torch.equal(saved[name], tensor), (rank, name)
    assert torch.equal(saved["head.weight"], saved["embed.weight"])
    fresh = _Tied().to(torch.bfloat16)
    fresh.load_state_dict(saved, strict=True)
    assert torch.equal(fresh.embed.weight, saved["embed.weight"])
    unfrozen = load_file(base / "rank0" / "sub" / "weights.safetensors")
    assert set(unfrozen) == {"embed.weight", "head.weight"}
