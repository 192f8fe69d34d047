"""A config naming Muon trains through ``initialize`` like plain Muon in one process.

Muon is not element-wise, so the engine hands ZeRO a full-gradient transform for Muon's
``use_muon`` matrices (ZeRO reduces their gradients whole and Muon receives the finished
update). One ``run_on_mesh`` call on 2 ranks trains the MLP for `STEPS` steps at ZeRO stages 0,
1 and 2 with ``{"type": "Muon"}``; the parent trains ``deepshard.optimizers.Muon`` on the whole
batch in one process. Clipping is off, so both sides apply exactly Muon's update (how ZeRO
clips a Muon update is ZeRO's own test). Tolerance: parameters to 1e-4 relative per tensor
(fp32; Newton-Schulz iterations amplify the reduction-order differences of the gradient a little
beyond AdamW's 1e-5).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from deepshard.optimizers import Muon
from deepshard.testing import run_on_mesh


def _load() -> Any:
    """``tests/_models.py``, imported by path (importlib mode keeps tests/ off sys.path)."""
    key = "_deepshard_engine_tests_models"
    if key not in sys.modules:
        spec = importlib.util.spec_from_file_location(key, Path(__file__).with_name("_models.py"))
        assert spec is not None and spec.loader is not None
        sys.modules[key] = module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return sys.modules[key]


_models = _load()
STEPS = 5
MUON = {"muon_lr": 0.02, "adam_lr": 1e-2, "weight_decay": 0.1, "momentum": 0.95}


def _train(mesh: Any, stage: int) -> list[torch.Tensor]:
    import deepshard.engine as ds

    rank, world = mesh.get_rank(), mesh.size()
    model = _models.make_mlp()
    config = _models.engine_config(stage=stage, precision="fp32", ga=1)
    config.update(optimizer={"type": "Muon", "params": MUON}, gradient_clipping=0.0)
    engine, _, _, _ = ds.initialize(model, config, mesh=mesh)
    for step in range(STEPS):
        rows = _models.micro_batch(_models.mlp_batch(step), micro=0, rank=rank, world=world, ga=1)
        engine.backward(_models.mlp_loss(engine, rows, torch.float32))
        engine.step()
    return [p.detach().clone() for p in model.parameters()]


def _all_stages(mesh: Any) -> dict[int, list[torch.Tensor]]:
    return {stage: _train(mesh, stage) for stage in (0, 1, 2)}


def _reference() -> list[torch.Tensor]:
    model = _models.make_mlp()
    muon = Muon(model.named_parameters(), **MUON)
    for step in range(STEPS):
        muon.zero_grad()
        _models.mlp_loss(model, _models.mlp_batch(step), torch.float32).backward()
        muon.step()
    return [p.detach().clone() for p in model.parameters()]


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[int, list[torch.Tensor]]]:
    return run_on_mesh(_all_stages, 2, store_dir=tmp_path_factory.mktemp("muon"), timeout_s=120)


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_muon_config_trains_like_plain_muon(
    results: list[dict[int, list[torch.Tensor]]], stage: int
) -> None:
    expected = _reference()
    initial = [p.detach() for p in _models.make_mlp().parameters()]
    for got, want, start in zip(results[0][stage], expected, initial, strict=True):
        assert not torch.equal(want, start)  # every tensor moved
        error = float((got - want).norm() / want.norm())
        assert error <= 1e-4, f"stage {stage}: off by {error:.3g} relative"
