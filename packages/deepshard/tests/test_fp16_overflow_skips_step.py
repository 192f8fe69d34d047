"""fp16: an overflowing step is skipped at every ZeRO stage, and the loss is always scaled.

One ``run_on_mesh`` call on 2 ranks trains the MLP in fp16 for `STEPS` steps with 2
accumulation steps, a dynamic loss scale starting at ``2**8`` with hysteresis 1, and a WarmupLR
schedule, at ZeRO stages 0, 1 and 2. At step `POISONED` a gradient hook on rank 1 only turns one
micro-batch's gradient of the first weight into inf/nan. Then, at every stage:

* that step, on both ranks, is not applied: the parameters, the optimizer's state (its step
  count) and the schedule's position stay as they were, and ``skipped_steps`` is 1;
* the loss scale halves (256 -> 128: hysteresis 1 lowers at the first overflow) and stays;
* the first step's gradient norm (unscaled) matches an fp32 computation of the same gradient to
  fp16 precision: had the loss not been multiplied by the scale at some stage while the
  gradients are divided by it (DeepSpeed 0.19.7's stage 0), it would be 256 times too small;
* stages 0, 1 and 2 end with the same parameters, to 2 fp16 ulps (stage 2 reduces every
  micro-batch on its own, so its fp16 sums round differently).
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from deepshard.testing import import_beside, run_on_mesh

pytestmark = pytest.mark.slow  # the main run covers it; the package env keeps a few lighter ones

_models = import_beside(__file__, "_models.py")
STEPS = 6
POISONED = 3
GA = 2
FP16_U = 2.0**-11


def _config(stage: int) -> dict[str, Any]:
    config = _models.engine_config(stage=stage, precision="fp32", ga=GA)
    config["fp16"] = {"enabled": True, "initial_scale_power": 8, "hysteresis": 1}
    config["scheduler"] = {
        "type": "WarmupLR",
        "params": {"warmup_num_steps": 10, "warmup_type": "linear"},
    }
    return config


def _optimizer_steps(engine: Any) -> int:
    counts = {int(s["step"]) for s in engine.optimizer.state.values()}
    assert len(counts) == 1, counts
    return counts.pop()


def _equal(first: list[torch.Tensor] | None, second: list[torch.Tensor] | None) -> bool:
    assert first is not None and second is not None
    return all(torch.equal(a, b) for a, b in zip(first, second, strict=True))


def _train(mesh: Any, stage: int) -> dict[str, Any]:
    import deepshard.engine as ds

    rank, world = mesh.get_rank(), mesh.size()
    model = _models.make_mlp()
    engine, _, _, schedule = ds.initialize(model, _config(stage), mesh=mesh)
    poison = torch.ones(())
    model[0].weight.register_hook(lambda grad: grad * poison)
    log: dict[str, list[Any]] = {"applied": [], "scale": [], "lr": [], "state_steps": []}
    norms, before_poison, after_poison = [], None, None
    for step in range(STEPS):
        if step == POISONED:
            before_poison = [p.detach().clone() for p in model.parameters()]
        for micro in range(GA):
            hit = step == POISONED and micro == 1 and rank == 1
            poison.fill_(math.inf if hit else 1.0)
            rows = _models.micro_batch(
                _models.mlp_batch(step), micro=micro, rank=rank, world=world, ga=GA
            )
            engine.backward(_models.mlp_loss(engine, rows, torch.float16))
            engine.step()
        if step == POISONED:
            after_poison = [p.detach().clone() for p in model.parameters()]
        log["applied"].append(engine.was_step_applied())
        log["scale"].append(engine.loss_scale)
        log["lr"].append(engine.get_lr()[0])
        log["state_steps"].append(_optimizer_steps(engine))
        norms.append(engine.get_global_grad_norm())
    return {
        **log,
        "norms": norms,
        "unchanged": _equal(before_poison, after_poison),
        "schedule_position": schedule.last_batch_iteration,
        "skipped": engine.skipped_steps,
        "params": torch.cat([p.detach().float().reshape(-1) for p in model.parameters()]),
    }


def _all_stages(mesh: Any) -> dict[int, dict[str, Any]]:
    return {stage: _train(mesh, stage) for stage in (0, 1, 2)}


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[int, dict[str, Any]]]:
    return run_on_mesh(_all_stages, 2, store_dir=tmp_path_factory.mktemp("fp16"), timeout_s=180)


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_the_overflowing_step_is_skipped_on_every_rank(
    results: list[dict[int, dict[str, Any]]], stage: int
) -> None:
    applied = [step != POISONED for step in range(STEPS)]
    for rank_results in results:
        got = rank_results[stage]
        assert got["applied"] == applied
        assert got["unchanged"], "the skipped step changed the parameters"
        assert got["skipped"] == 1
        assert not math.isfinite(got["norms"][POISONED])
        # The optimizer state advanced once per applied step, never on the skipped one.
        assert got["state_steps"] == [sum(applied[: s + 1]) for s in range(STEPS)]


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_the_schedule_does_not_advance_and_the_scale_halves(
    results: list[dict[int, dict[str, Any]]], stage: int
) -> None:
    got = results[0][stage]
    assert got["schedule_position"] == STEPS - 1 - 1  # -1 at start, one step per applied step
    assert got["lr"][POISONED] == got["lr"][POISONED - 1]
    assert got["lr"][POISONED + 1] != got["lr"][POISONED]
    assert got["scale"] == [256.0] * POISONED + [128.0] * (STEPS - POISONED)


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_the_loss_is_scaled_at_every_stage(
    results: list[dict[int, dict[str, Any]]], stage: int
) -> None:
    model = _models.make_mlp()
    _models.mlp_loss(model, _models.mlp_batch(0), torch.float32).backward()
    expected = float(torch.cat([p.grad.reshape(-1) for p in model.parameters()]).norm())
    got = results[0][stage]["norms"][0]
    assert got == pytest.approx(expected, rel=16 * FP16_U)


def test_stage_0_matches_stages_1_and_2(results: list[dict[int, dict[str, Any]]]) -> None:
    for stage in (1, 2):
        torch.testing.assert_close(
            results[0][stage]["params"], results[0][0]["params"], rtol=4 * FP16_U, atol=1e-4
        )
