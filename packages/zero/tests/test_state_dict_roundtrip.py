"""A rank's ZeRO state saved mid-run and loaded into a fresh model and wrapper continues the run
exactly (stages 1 and 2 on 2 ranks); state from another layout is refused."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from deepshard.testing import import_beside, run_on_mesh

_training = import_beside(__file__, "_training.py")
WORLD = 2


def _setup(group: Any, stage: int, seed: int) -> tuple[torch.nn.Module, Any]:
    from deepshard.interface.config import ZeroConfig
    from deepshard.zero import ZeroOptimizer

    model = _training.make_model(torch.bfloat16, seed=seed)
    inner = torch.optim.AdamW(_training.param_groups(list(model.parameters())), lr=_training.LR)
    return model, ZeroOptimizer(inner, group=group, config=ZeroConfig(stage=stage))


def _steps(model: torch.nn.Module, zero: Any, rank: int, steps: range) -> None:
    mb = _training.GLOBAL_BATCH // WORLD
    for step in steps:
        x, y = _training.batch(step)
        rows = slice(rank * mb, (rank + 1) * mb)
        zero.backward(_training.loss_fn(model, x[rows], y[rows]))
        zero.step()


def _roundtrip(mesh: Any) -> dict[str, Any]:
    from deepshard.interface.errors import CheckpointError

    group, rank = mesh["dp"], mesh.get_rank()
    out: dict[str, Any] = {}
    for stage in (1, 2):
        model, zero = _setup(group, stage, seed=0)
        _steps(model, zero, rank, range(4))
        straight = [p.detach().clone() for p in model.parameters()]

        model, zero = _setup(group, stage, seed=0)
        _steps(model, zero, rank, range(2))
        saved = zero.state_dict()
        model, zero = _setup(group, stage, seed=1)  # other weights: the load must restore them
        zero.load_state_dict(saved)
        _steps(model, zero, rank, range(2, 4))
        resumed = [p.detach().clone() for p in model.parameters()]
        out[f"stage{stage}"] = all(
            torch.equal(a, b) for a, b in zip(straight, resumed, strict=True)
        )
        try:
            zero.load_state_dict({**saved, "partition_rank": 1 - rank})
        except CheckpointError as exc:
            out[f"refused{stage}"] = str(exc)
    return out


def test_state_dict_resumes_exactly(tmp_path: Path) -> None:
    for out in run_on_mesh(_roundtrip, WORLD, store_dir=tmp_path):
        for stage in (1, 2):
            assert out[f"stage{stage}"], f"stage {stage} did not resume exactly"
            assert "partition_rank" in out[f"refused{stage}"]
