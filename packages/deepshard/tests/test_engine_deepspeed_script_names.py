"""More engine names DeepSpeed scripts call, on 2 gloo ranks.

* ``engine.step(lr_kwargs={"increment": 3})`` (Megatron-DeepSpeed) passes the keywords to the
  scheduler's ``step`` after an applied update, and only then.
* ``engine._zero3_consolidated_16bit_state_dict()`` at ZeRO stage 3: the gathered state dict on
  rank 0 (equal to ``module_state_dict()``), None on rank 1; below stage 3 it is refused with
  the method to use.
* ``engine.optimizer.overflow`` is False after an applied step and True after one skipped for
  non-finite gradients (stage 0; stage 3 checked after an applied step);
  ``engine.global_steps = 100`` (Megatron-DeepSpeed's resume) sets the counter, the next
  boundary makes it 101, and a negative value is refused.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from deepshard.testing import run_on_mesh

pytestmark = pytest.mark.slow  # the main run covers it; the package env keeps lighter ones


class _CountingSchedule:
    """A client scheduler with Megatron's ``step(increment=...)``."""

    def __init__(self, optimizer: Any) -> None:
        self.optimizer = optimizer
        self.steps: list[int] = []

    def step(self, increment: int = 1) -> None:
        self.steps.append(increment)

    def get_last_lr(self) -> list[float]:
        return [group["lr"] for group in self.optimizer.param_groups]

    def state_dict(self) -> dict[str, Any]:
        return {"steps": self.steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.steps = list(state["steps"])


def _engine(mesh: Any, stage: int, **kwargs: Any) -> Any:
    import deepshard.engine as ds

    torch.manual_seed(0)
    config = {
        "train_batch_size": 4,
        "gradient_accumulation_steps": 2,
        "zero_optimization": {"stage": stage},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
    }
    return ds.initialize(model=torch.nn.Linear(4, 3), config=config, mesh=mesh, **kwargs)


def _train_micro(engine: Any, micro: int) -> None:
    x = torch.randn(1, 4, generator=torch.Generator().manual_seed(micro))
    engine.backward(engine(x).square().mean())


def _run(mesh: Any) -> dict[str, Any]:
    import deepshard.engine as ds

    out: dict[str, Any] = {}
    result = _engine(mesh, 0, lr_scheduler=_CountingSchedule)
    engine, schedule = result.engine, result.lr_scheduler
    for micro in range(4):
        _train_micro(engine, micro)
        engine.step(lr_kwargs={"increment": 3})
    out["increments"] = list(schedule.steps)
    out["overflow"] = [engine.optimizer.overflow]
    for micro in range(2):
        x = torch.randn(1, 4, generator=torch.Generator().manual_seed(micro))
        engine.backward(engine(x).sum() * float("inf"))
        engine.step()
    out["overflow"].append(engine.optimizer.overflow)
    engine.global_steps = 100
    _train_micro(engine, 0)
    engine.step()
    _train_micro(engine, 1)
    engine.step()
    out["global_steps"] = engine.global_steps
    try:
        engine.global_steps = -1
    except ds.ConfigError as error:
        out["negative"] = str(error)
    try:
        engine._zero3_consolidated_16bit_state_dict()
    except ds.ConfigError as error:
        out["below_stage3"] = str(error)
    engine = _engine(mesh, 3).engine
    _train_micro(engine, 0)
    engine.step()
    _train_micro(engine, 1)
    engine.step()
    out["overflow3"] = engine.optimizer.overflow
    consolidated = engine._zero3_consolidated_16bit_state_dict()
    whole = engine.module_state_dict()
    out["consolidated"] = (
        None
        if consolidated is None
        else {key: torch.equal(value, whole[key]) for key, value in consolidated.items()}
    )
    out["keys"] = sorted(whole)
    return out


def test_step_lr_kwargs_and_consolidated_state_dict() -> None:
    rank0, rank1 = run_on_mesh(_run, 2, timeout_s=180)
    for got in (rank0, rank1):
        assert got["increments"] == [3, 3]  # two boundaries of 2 micro-steps each
        assert "needs ZeRO stage 3" in got["below_stage3"]
        assert "engine.module_state_dict()" in got["below_stage3"]
        assert got["overflow"] == [False, True] and got["overflow3"] is False
        assert got["global_steps"] == 101
        assert "int >= 0" in got["negative"]
    assert rank0["consolidated"] == {key: True for key in rank0["keys"]}
    assert rank0["keys"] == ["bias", "weight"]
    assert rank1["consolidated"] is None
