"""``loss.backward()`` on the engine's output trains like ``engine.backward(loss)``.

DeepSpeed 0.19.7 lets a script call ``loss.backward()`` itself and divides for accumulation
by dividing the gradient at every output tensor, twice when the returned loss was computed
from a returned ``logits`` (``1/ga²``). DeepShard divides once, at the boundary. On 2 gloo
ranks at ZeRO stage 2 with 2 accumulation steps, a model returning ``{"loss", "logits"}``
(the loss computed from the logits, as Hugging Face models return them):

* plain ``out["loss"].backward()`` ends with the same parameters as ``engine.backward`` (bit for
  bit: both divisions are by a power of two);
* under fp16 loss scaling, ``engine.scale(loss).backward()`` also matches ``engine.backward``,
  and an unscaled ``loss.backward()`` is refused with a ``ConfigError`` naming the fix;
* a cycle mixing both kinds is refused at its boundary step.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from deepshard.testing import run_on_mesh

pytestmark = pytest.mark.slow  # the main run covers it; the package env keeps lighter ones

GA = 2


class _LossAndLogits(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = torch.nn.Sequential(
            torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 5)
        )

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
        logits = self.body(x)
        return {"loss": torch.nn.functional.cross_entropy(logits.float(), y), "logits": logits}


def _config(fp16: bool) -> dict[str, Any]:
    return {
        "train_batch_size": 8,
        "gradient_accumulation_steps": GA,
        "fp16": {"enabled": fp16, "initial_scale_power": 8},
        "zero_optimization": {"stage": 2},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
    }


def _batch(micro: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(10 * micro + rank)
    return torch.randn(2, 6, generator=gen), torch.randint(0, 5, (2,), generator=gen)


def _train(mesh: Any, how: str, fp16: bool) -> torch.Tensor:
    import deepshard.engine as ds

    engine = ds.initialize(model=_LossAndLogits(), config=_config(fp16), mesh=mesh).engine
    dtype = torch.float16 if fp16 else torch.float32
    for micro in range(2 * GA):
        x, y = _batch(micro, mesh.get_rank())
        loss = engine(x.to(dtype), y)["loss"]
        if how == "engine":
            engine.backward(loss)
        elif how == "plain":
            loss.backward()
        else:
            engine.scale(loss).backward()
        engine.step()
    return torch.cat([p.detach().float().reshape(-1) for p in engine.module.parameters()])


def _refusals(mesh: Any) -> dict[str, str]:
    import deepshard.engine as ds

    out = {}
    engine = ds.initialize(model=_LossAndLogits(), config=_config(True), mesh=mesh).engine
    x, y = _batch(0, mesh.get_rank())
    try:
        engine(x.half(), y)["loss"].backward()
    except ds.ConfigError as error:
        out["unscaled"] = str(error)
    engine = ds.initialize(model=_LossAndLogits(), config=_config(False), mesh=mesh).engine
    engine(x, y)["loss"].backward()
    engine.step()
    engine.backward(engine(x, y)["loss"])
    try:
        engine.step()
    except ds.ConfigError as error:
        out["mixed"] = str(error)
    return out


def _all(mesh: Any) -> dict[str, Any]:
    return {
        "fp32": [_train(mesh, how, False) for how in ("engine", "plain")],
        "fp16": [_train(mesh, how, True) for how in ("engine", "scaled")],
        "refusals": _refusals(mesh),
    }


def test_plain_backward_trains_like_engine_backward() -> None:
    for got in run_on_mesh(_all, 2, timeout_s=180):
        engine, plain = got["fp32"]
        assert torch.equal(engine, plain)
        engine16, scaled16 = got["fp16"]
        assert torch.equal(engine16, scaled16)
        assert "engine.scale(loss).backward()" in got["refusals"]["unscaled"]
        assert "mixed engine.backward(loss) with loss.backward()" in got["refusals"]["mixed"]
