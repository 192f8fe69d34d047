"""Updates happen exactly at accumulation boundaries, however the backward pass is driven.

One ``run_on_mesh`` call on 2 ranks, for ZeRO stages 0, 1 and 2:

* With 4 accumulation steps and 12 micro-steps, ``engine.step()`` applies an update exactly
  after micro-steps 4, 8 and 12; the parameters change only then; the counters end at
  ``global_steps == 3``, ``micro_steps == 12`` and ``global_samples == 3 × train_batch_size``.
* A plain ``loss.backward()`` on the engine's output (ZeRO's hooks do the reduction, the
  engine divides by the accumulation steps at the boundary, as DeepSpeed does) trains to the
  same parameters as ``engine.backward(loss)``.
* Two backward passes inside ``engine.no_sync()`` followed by a normal one, with one
  accumulation step configured, train like three accumulation steps.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from deepshard.engine._accumulation import GradientAccumulation
from deepshard.interface.errors import CheckpointError
from deepshard.testing import import_beside, run_on_mesh

pytestmark = pytest.mark.slow  # the main run covers it; the package env keeps a few lighter ones

_models = import_beside(__file__, "_models.py")
GA = 4
MICRO_STEPS = 12


def _rows(step: int, micro: int, rank: int, world: int, ga: int) -> tuple[torch.Tensor, ...]:
    return _models.micro_batch(_models.mlp_batch(step), micro=micro, rank=rank, world=world, ga=ga)


def _snapshot(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])


def _counters(mesh: Any, stage: int) -> dict[str, Any]:
    import deepshard.engine as ds

    rank, world = mesh.get_rank(), mesh.size()
    model = _models.make_mlp()
    config = _models.engine_config(stage=stage, precision="fp32", ga=GA)
    engine, _, _, _ = ds.initialize(model, config, mesh=mesh)
    applied, boundaries, changed = [], [], []
    for micro_step in range(MICRO_STEPS):
        before = _snapshot(model)
        rows = _rows(micro_step // GA, micro_step % GA, rank, world, GA)
        boundaries.append(engine.is_gradient_accumulation_boundary())
        engine.backward(_models.mlp_loss(engine, rows, torch.float32))
        engine.step()
        applied.append(engine.was_step_applied())
        changed.append(not torch.equal(before, _snapshot(model)))
    return {
        "applied": applied,
        "boundaries": boundaries,
        "changed": changed,
        "counters": (engine.global_steps, engine.micro_steps, engine.global_samples),
        "train_batch_size": engine.train_batch_size(),
    }


def _train(mesh: Any, stage: int, *, plain: bool) -> torch.Tensor:
    import deepshard.engine as ds

    rank, world = mesh.get_rank(), mesh.size()
    model = _models.make_mlp()
    config = _models.engine_config(stage=stage, precision="fp32", ga=GA)
    engine, _, _, _ = ds.initialize(model, config, mesh=mesh)
    for micro_step in range(2 * GA):
        rows = _rows(micro_step // GA, micro_step % GA, rank, world, GA)
        loss = _models.mlp_loss(engine, rows, torch.float32)
        if plain:
            loss.backward()
        else:
            engine.backward(loss)
        engine.step()
    return _snapshot(model)


def _no_sync(mesh: Any, stage: int, *, use_no_sync: bool) -> torch.Tensor:
    import deepshard.engine as ds

    rank, world = mesh.get_rank(), mesh.size()
    ga = 3
    model = _models.make_mlp()
    config = _models.engine_config(stage=stage, precision="fp32", ga=1 if use_no_sync else ga)
    del config["train_batch_size"]  # the micro-batch is the same in both runs
    config["train_micro_batch_size_per_gpu"] = _models.GLOBAL_BATCH // (world * ga)
    engine, _, _, _ = ds.initialize(model, config, mesh=mesh)
    for micro in range(ga):
        loss = _models.mlp_loss(engine, _rows(0, micro, rank, world, ga), torch.float32)
        if not use_no_sync:
            engine.backward(loss)
            engine.step()
        elif micro < ga - 1:
            with engine.no_sync():
                engine.backward(loss / ga)
        else:
            engine.backward(loss / ga)
            engine.step()
    assert engine.global_steps == 1
    return _snapshot(model)


def _all_stages(mesh: Any) -> dict[int, dict[str, Any]]:
    results = {}
    for stage in (0, 1, 2):
        results[stage] = {
            **_counters(mesh, stage),
            "engine_backward": _train(mesh, stage, plain=False),
            "plain_backward": _train(mesh, stage, plain=True),
            "accumulated": _no_sync(mesh, stage, use_no_sync=False),
            "no_sync": _no_sync(mesh, stage, use_no_sync=True),
        }
    return results


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[int, dict[str, Any]]]:
    return run_on_mesh(_all_stages, 2, store_dir=tmp_path_factory.mktemp("acc"), timeout_s=180)


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_updates_apply_exactly_at_micro_steps_4_8_12(
    results: list[dict[int, dict[str, Any]]], stage: int
) -> None:
    got = results[0][stage]
    expected = [(k + 1) % GA == 0 for k in range(MICRO_STEPS)]  # the 4th, 8th and 12th call
    assert got["boundaries"] == expected
    assert got["applied"] == expected
    assert got["changed"] == expected
    assert got["counters"] == (3, MICRO_STEPS, 3 * got["train_batch_size"])


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_plain_loss_backward_trains_like_engine_backward(
    results: list[dict[int, dict[str, Any]]], stage: int
) -> None:
    for rank_results in results:
        got = rank_results[stage]
        torch.testing.assert_close(got["plain_backward"], got["engine_backward"])


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_backward_inside_no_sync_accumulates(
    results: list[dict[int, dict[str, Any]]], stage: int
) -> None:
    got = results[0][stage]
    torch.testing.assert_close(got["no_sync"], got["accumulated"])


def test_counter_state_round_trips() -> None:
    counter = GradientAccumulation(steps=2, train_batch_size=8)
    for applied in (True, True, True, False):
        counter.advance(applied=applied)
    assert (counter.global_steps, counter.skipped_steps, counter.global_samples) == (2, 1, 16)
    resumed = GradientAccumulation(steps=2, train_batch_size=8)
    resumed.load_state_dict(counter.state_dict())
    assert resumed.state_dict() == counter.state_dict()
    with pytest.raises(CheckpointError, match="skipped_steps"):
        resumed.load_state_dict({"micro_steps": 0, "global_steps": 0, "global_samples": 0})
