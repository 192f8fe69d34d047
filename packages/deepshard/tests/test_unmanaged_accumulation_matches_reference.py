"""``managed_gradient_accumulation: false``: each ``step()`` ends the cycle, however many passes.

DeepSpeed 0.19's caller-owned accumulation: backward passes only accumulate, and every
``engine.step()`` reduces and applies what they accumulated, so a loop may run 1, 3 or 2
micro-batches before each step. On 2 gloo ranks at ZeRO stages 0-3, three steps of 1, 3 and 2
micro-batches must give the losses and weights of one process that, per step, adds the
gradients of every micro-batch of both ranks (each loss divided by ``gradient_accumulation_steps``
as ``engine.backward`` does, then the ranks' mean) and steps SGD. The counters: three global
steps, samples = micro-batches x micro batch x ranks. ``set_gradient_accumulation_boundary`` is
refused (there is no boundary to declare), and ``ignore_unused_parameters: false`` does not
trip on the empty pass that ends a stage-0/1 cycle.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from deepshard.engine._accumulation import GradientAccumulation
from deepshard.testing import run_on_mesh

PASSES = (1, 3, 2)  # micro-batches before each step
MICRO, LR, GAS = 2, 0.1, 2


def test_the_counter_follows_the_callers_steps() -> None:
    counter = GradientAccumulation(GAS, train_batch_size=8, managed=False)
    assert not counter.is_boundary()  # backward passes are never boundaries
    counter.backwards = 3
    counter.stepping = True
    assert counter.is_boundary()
    counter.advance(applied=True)
    counter.stepping = False
    assert (counter.global_steps, counter.micro_steps, counter.global_samples) == (1, 1, 3 * 4)
    assert counter.backwards == 0 and not counter.is_boundary()


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))


def _batch(step: int, micro: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 * step + 10 * micro + rank)
    return torch.randn(MICRO, 5, generator=gen), torch.randn(MICRO, 3, generator=gen)


def _loss(model: Any, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return torch.nn.functional.mse_loss(model(x), y)


def _train(mesh: Any, stage: int) -> dict[str, Any]:
    import deepshard.engine as ds
    from deepshard.zero import GatheredParameters

    config = {
        "train_batch_size": MICRO * GAS * 2,
        "train_micro_batch_size_per_gpu": MICRO,
        "managed_gradient_accumulation": False,
        "gradient_clipping": 0.0,
        "optimizer": {"type": "SGD", "params": {"lr": LR}},
        "zero_optimization": {"stage": stage, "ignore_unused_parameters": False},
    }
    engine, *_ = ds.initialize(_model(), config, mesh=mesh)
    rank, losses = mesh.get_rank(), []
    for step, passes in enumerate(PASSES):
        for micro in range(passes):
            loss = _loss(engine, _batch(step, micro, rank))
            engine.backward(loss)
            losses.append(float(loss.detach()))
        engine.step()
    try:
        engine.set_gradient_accumulation_boundary(True)
        refused = ""
    except ds.ConfigError as error:
        refused = str(error)
    named = dict(engine.module.named_parameters())
    if stage == 3:
        with GatheredParameters(list(named.values())):
            params = {n: p.detach().clone() for n, p in named.items()}
    else:
        params = {n: p.detach().clone() for n, p in named.items()}
    counters = (engine.global_steps, engine.global_samples)
    return {"losses": losses, "params": params, "counters": counters, "refused": refused}


def _all_stages(mesh: Any) -> dict[int, Any]:
    return {stage: _train(mesh, stage) for stage in (0, 1, 2, 3)}


def _reference() -> dict[str, Any]:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses: dict[int, list[float]] = {0: [], 1: []}
    for step, passes in enumerate(PASSES):
        for micro in range(passes):
            for rank in (0, 1):
                loss = _loss(model, _batch(step, micro, rank))
                (loss / GAS / 2).backward()  # engine.backward's / GAS, then the ranks' mean
                losses[rank].append(float(loss.detach()))
        opt.step()
        opt.zero_grad()
    return {"losses": losses, "params": {n: p.detach() for n, p in model.named_parameters()}}


@pytest.mark.slow  # 2 gloo ranks, four engines; the main run has it
def test_every_step_ends_its_cycle_at_stages_0_to_3() -> None:
    ranks = run_on_mesh(_all_stages, 2, timeout_s=180)
    ref = _reference()
    for rank, by_stage in enumerate(ranks):
        for stage, out in by_stage.items():
            torch.testing.assert_close(out["losses"], ref["losses"][rank], rtol=1e-5, atol=1e-6)
            for name, value in ref["params"].items():
                torch.testing.assert_close(
                    out["params"][name], value, rtol=1e-5, atol=1e-6,
                    msg=lambda m, s=stage, n=name: f"stage {s}, {n}: {m}",
                )  # fmt: skip
            assert out["counters"] == (3, sum(PASSES) * MICRO * 2), stage
            assert "managed_gradient_accumulation" in out["refused"], stage
