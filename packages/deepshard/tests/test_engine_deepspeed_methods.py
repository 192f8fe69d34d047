"""The engine methods DeepSpeed scripts call, on 2 gloo ranks at ZeRO stages 0, 1 and 2.

* The readers answer from the config: ``zero_optimization_stage()``, ``bfloat16_enabled()``,
  ``fp16_enabled()``, ``gradient_clipping()``; ``get_mom()`` gives AdamW's betas (torch's
  defaults) and SGD's momentum.
* ``set_gradient_accumulation_boundary``: False for all but the last of 4 backward passes, then
  True and one ``step()``, trains to the same weights as 4 counter-driven micro-steps.
* ``zero_grad()`` drops a backward pass: the run equals one without that pass.
* ``destroy()`` detaches ZeRO (a plain backward then leaves ``param.grad``) and refuses training.
* A non-scalar loss is refused by ``backward`` and ``scale``; nested ``no_sync()`` and ``step()``
  inside ``no_sync()`` are refused, and ``no_sync()`` works again afterwards.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from deepshard.testing import import_beside, run_on_mesh

pytestmark = pytest.mark.slow  # the main run covers it; the package env keeps a few lighter ones

_models = import_beside(__file__, "_models.py")
GA = 4
STAGES = (0, 1, 2)


def _engine(mesh: Any, stage: int, **extra: Any) -> Any:
    import deepshard.engine as ds

    config = _models.engine_config(stage=stage, precision="fp32", ga=GA, **extra)
    return ds.initialize(_models.make_mlp(), config, mesh=mesh).engine


def _loss(engine: Any, micro: int, world: int, rank: int) -> torch.Tensor:
    batch = _models.micro_batch(_models.mlp_batch(0), micro=micro, rank=rank, world=world, ga=GA)
    return _models.mlp_loss(engine, batch, torch.float32)


def _weights(engine: Any) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).clone() for p in engine.module.parameters()])


def _readers(mesh: Any, stage: int) -> dict[str, Any]:
    import deepshard.engine as ds

    engine = _engine(mesh, stage, bf16={"enabled": True})
    sgd = {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.7}}
    sgd_engine = ds.initialize(
        _models.make_mlp(), {"train_batch_size": 4, "optimizer": sgd}, mesh=mesh
    ).engine
    return {
        "stage": engine.zero_optimization_stage(),
        "bf16": engine.bfloat16_enabled(),
        "fp16": engine.fp16_enabled(),
        "clip": engine.gradient_clipping(),
        "adam_mom": [tuple(m) for m in engine.get_mom()],
        "sgd_mom": sgd_engine.get_mom(),
    }


def _manual_boundary(mesh: Any, stage: int) -> dict[str, Any]:
    rank, world = mesh.get_rank(), mesh.size()
    counted = _engine(mesh, stage)
    for micro in range(GA):
        counted.backward(_loss(counted, micro, world, rank))
        counted.step()
    manual = _engine(mesh, stage)
    manual.set_gradient_accumulation_boundary(False)
    flags = []
    for micro in range(GA):
        if micro == GA - 1:
            manual.set_gradient_accumulation_boundary(True)
        flags.append(manual.is_gradient_accumulation_boundary())
        manual.backward(_loss(manual, micro, world, rank))
    manual.step()
    return {
        "counted": _weights(counted),
        "manual": _weights(manual),
        "flags": flags,
        "steps": (counted.global_steps, manual.global_steps, manual.was_step_applied()),
    }


def _zero_grad(mesh: Any, stage: int) -> dict[str, torch.Tensor]:
    rank, world = mesh.get_rank(), mesh.size()
    weights = {}
    for drop in (False, True):
        engine = _engine(mesh, stage)
        if drop:  # a pass on other data, then dropped
            engine.backward(_loss(engine, GA - 1, world, rank) * 10)
            engine.zero_grad()
        for micro in range(GA):
            engine.backward(_loss(engine, micro, world, rank))
            engine.step()
        weights[str(drop)] = _weights(engine)
    return weights


def _refusals(mesh: Any, stage: int) -> dict[str, Any]:
    import deepshard.engine as ds

    rank, world = mesh.get_rank(), mesh.size()
    engine = _engine(mesh, stage)
    refused = {}
    for what, call in (
        ("backward", lambda: engine.backward(engine(torch.ones(3, 13)))),
        ("scale", lambda: engine.scale(torch.ones(2))),
    ):
        try:
            call()
        except ds.ConfigError as error:
            refused[what] = str(error)
    refused["scale_one_element"] = engine.scale(torch.ones(1)).shape == (1,)
    for what in ("nested", "step"):
        try:
            with engine.no_sync():
                if what == "nested":
                    with engine.no_sync():
                        pass
                engine.step()
        except ds.CommError as error:
            refused[what] = str(error)
    with engine.no_sync():  # usable again after both refusals
        engine.backward(_loss(engine, 0, world, rank))
    return refused


def _destroy(mesh: Any, stage: int) -> dict[str, Any]:
    import deepshard.engine as ds

    rank, world = mesh.get_rank(), mesh.size()
    engine = _engine(mesh, stage)
    _loss(engine, 0, world, rank).backward()
    grads_while_wrapped = [p.grad is None for p in engine.module.parameters()]
    engine.destroy()
    engine.destroy()  # a second call does nothing
    _loss(engine, 0, world, rank).backward()
    refused = ""
    try:
        engine.step()
    except ds.CommError as error:
        refused = str(error)
    return {
        "wrapped_grads_none": all(grads_while_wrapped),
        "plain_grads_after": all(p.grad is not None for p in engine.module.parameters()),
        "refused": refused,
    }


def _all(mesh: Any) -> dict[int, dict[str, Any]]:
    return {
        stage: {
            "readers": _readers(mesh, stage),
            "manual": _manual_boundary(mesh, stage),
            "zero_grad": _zero_grad(mesh, stage),
            "refusals": _refusals(mesh, stage),
            "destroy": _destroy(mesh, stage),
        }
        for stage in STAGES
    }


@pytest.fixture(scope="module")
def results() -> list[dict[int, dict[str, Any]]]:
    """One 2-rank run covers the three stages (each run costs seconds of process start-up)."""
    return run_on_mesh(_all, 2, timeout_s=180)


@pytest.mark.parametrize("stage", STAGES)
def test_deepspeed_engine_methods(results: list[dict[int, dict[str, Any]]], stage: int) -> None:
    adam_betas = torch.optim.AdamW([torch.zeros(1)]).defaults["betas"]
    for by_stage in results:
        got = by_stage[stage]
        assert got["readers"] == {
            "stage": stage,
            "bf16": True,
            "fp16": False,
            "clip": _models.CLIP,
            "adam_mom": [tuple(adam_betas)],
            "sgd_mom": [0.7],
        }
        manual = got["manual"]
        torch.testing.assert_close(manual["manual"], manual["counted"], rtol=0, atol=0)
        assert not torch.equal(manual["manual"], _weights_of_fresh_mlp())
        assert manual["flags"] == [False] * (GA - 1) + [True]
        assert manual["steps"] == (1, 1, True)
        torch.testing.assert_close(got["zero_grad"]["True"], got["zero_grad"]["False"])
        refusals = got["refusals"]
        assert "needs a scalar loss, got shape (3, 7)" in refusals["backward"]
        assert "loss.mean()" in refusals["scale"]
        assert refusals["scale_one_element"]
        assert "nested no_sync() blocks are not supported" in refusals["nested"]
        assert "step() was called inside engine.no_sync()" in refusals["step"]
        assert got["destroy"]["wrapped_grads_none"]
        assert got["destroy"]["plain_grads_after"]
        assert "after engine.destroy()" in got["destroy"]["refused"]


def _weights_of_fresh_mlp() -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in _models.make_mlp().parameters()])
