"""``engine.offload_states()`` / ``reload_states()`` and the engine's ``safe_get_*`` on 2 ranks.

At ZeRO stages 0, 1 and 2 (fp32, 2 accumulation steps) one engine trains 4 steps plainly; another
offloads everything after step 1 (forward, backward and step are then refused with a message
naming ``reload_states()``), reloads, and during step 3 moves only the gradient buffers out and
back between the boundary's backward and the step, reading each parameter's full gradient
through ``engine.safe_get_full_grad`` before and after. Both engines end with the same weights
bit for bit, and ``engine.safe_get_full_fp32_param`` returns the module's own (fp32) weights.
``destroy()`` while offloaded brings the states back first. The DeepSpeed names are no longer in
the refused table.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from deepshard.testing import import_beside, run_on_mesh

pytestmark = pytest.mark.slow  # the main run covers it; the package env keeps a few lighter ones

_models = import_beside(__file__, "_models.py")
GA, STEPS = 2, 4
STAGES = (0, 1, 2)


def _engine(mesh: Any, stage: int) -> Any:
    import deepshard.engine as ds

    config = _models.engine_config(stage=stage, precision="fp32", ga=GA)
    return ds.initialize(_models.make_mlp(), config, mesh=mesh).engine


def _loss(engine: Any, step: int, micro: int, mesh: Any) -> torch.Tensor:
    batch = _models.micro_batch(
        _models.mlp_batch(step), micro=micro, rank=mesh.get_rank(), world=mesh.size(), ga=GA
    )
    return _models.mlp_loss(engine, batch, torch.float32)


def _refused(call: Any) -> str:
    import deepshard.engine as ds

    try:
        call()
    except ds.CommError as error:
        return str(error)
    return "not refused"


def _train(mesh: Any, stage: int, offload: bool) -> dict[str, Any]:
    engine = _engine(mesh, stage)
    out: dict[str, Any] = {}
    for step in range(STEPS):
        if offload and step == 2:
            loss = _loss(engine, step, 0, mesh)
            engine.offload_states()
            out["forward"] = _refused(lambda: engine(torch.ones(2, _models.SIZES[0])))
            out["backward"] = _refused(lambda loss=loss: engine.backward(loss))
            out["step"] = _refused(engine.step)
            engine.reload_states()
        for micro in range(GA):
            engine.backward(_loss(engine, step, micro, mesh))
            if offload and step == 3 and micro == GA - 1:
                params = list(engine.module.parameters())
                before = [engine.safe_get_full_grad(p) for p in params]
                engine.offload_states(include=["lp_grads", "contiguous_grad_buffer"])
                engine.reload_states()
                after = [engine.safe_get_full_grad(p) for p in params]
                out["grads_kept"] = all(
                    torch.equal(a, b) for a, b in zip(before, after, strict=True)
                )
            engine.step()
    params = list(engine.module.parameters())
    out["fp32_is_module"] = all(
        torch.equal(engine.safe_get_full_fp32_param(p), p.detach()) for p in params
    )
    out["weights"] = torch.cat([p.detach().reshape(-1).clone() for p in params])
    if offload:
        engine.offload_states(include=["optim_states", "lp_params"])
        engine.destroy()  # reloads first
        out["after_destroy"] = torch.cat([p.detach().reshape(-1) for p in params])
    return out


def _all(mesh: Any) -> dict[int, dict[bool, dict[str, Any]]]:
    return {stage: {flag: _train(mesh, stage, flag) for flag in (False, True)} for stage in STAGES}


@pytest.fixture(scope="module")
def results() -> list[dict[int, dict[bool, dict[str, Any]]]]:
    return run_on_mesh(_all, 2, timeout_s=180)


@pytest.mark.parametrize("stage", STAGES)
def test_engine_offload_and_reload(results: list[Any], stage: int) -> None:
    for by_stage in results:
        plain, moved = by_stage[stage][False], by_stage[stage][True]
        assert torch.equal(moved["weights"], plain["weights"])
        assert torch.equal(moved["after_destroy"], plain["weights"])
        assert moved["grads_kept"] and moved["fp32_is_module"] and plain["fp32_is_module"]
        for what in ("forward", "backward", "step"):
            assert f"engine.{what}() was called while the states" in moved[what], moved[what]
            assert "call reload_states() first" in moved[what]


def test_offload_names_are_no_longer_refused() -> None:
    from deepshard.engine._unsupported import REFUSED_ENGINE_NAMES

    assert "offload_states" not in REFUSED_ENGINE_NAMES
    assert "reload_states" not in REFUSED_ENGINE_NAMES
