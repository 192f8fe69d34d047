"""Through ``initialize``/``backward``/``step``, every ZeRO stage trains like one process.

Each world size (1, 2, 4) is one ``run_on_mesh`` call that trains every case: ZeRO stage 0, 1, 2
× fp32, bf16 × 1, 4 accumulation steps × the odd-sized MLP and a tiny LlamaForCausalLM, for
`STEPS` steps with AdamW and gradient clipping at 0.5 (which triggers: checked). The parent
computes the single-process reference on the concatenated global batch (`_models.reference`)
and compares per-step losses (mean over ranks), gradient norms and final parameters.

Tolerances:

* fp32: 1e-5 relative. Only the summation order differs (ranks, micro-batches), a few ulps per
  step that AdamW does not amplify. Losses and gradient norms are compared step by step;
  parameters tensor by tensor, as ``||p - p_ref|| / ||p_ref||`` (measured: <= 2e-6; single
  elements whose gradient is near zero can flip Adam's update direction, so per-element bounds
  would test AdamW's conditioning, not the engine).
* bf16: the model, its gradients and their reduction are bf16 (unit roundoff u = 2^-8); the
  reference runs one bf16 backward on the whole batch, the engine sums per-rank and
  per-micro-batch bf16 gradients. That O(u) noise is chaotic over 20 AdamW steps (an fp32-master
  bf16 run and a plain-bf16 run of the *reference itself* end 5-20 % of the travel apart), so:
  every step's loss within 4u relative (measured <= 0.6u), the first step's gradient norm
  within 4u (before the trajectories part), and the final parameters within 30 % of the
  distance the reference travelled from its initial weights (measured <= 15 %; untouched or
  corrupted parameters give >= 100 %). The precision mechanics themselves are checked
  directly in every bf16 run: bf16 parameters, fp32 master weights and optimizer state, and
  masters that carry more than bf16 precision after training.
* Stages against each other (same world, precision, accumulation): the same bounds, against
  stage 0 instead of the reference.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest
import torch

from deepshard.testing import import_beside, run_on_mesh

# multi-rank and over ~3 s: the main run covers it, the package tox env deselects it
pytestmark = pytest.mark.slow

_models = import_beside(__file__, "_models.py")

STEPS = 20
BF16_U = 2.0**-8
CASES = list(
    itertools.product(("mlp", "llama"), (0, 1, 2), ("fp32", "bf16"), (1, 4)),
)


def _train_all(mesh: Any, cases: list[tuple[str, int, str, int]], steps: int) -> dict[Any, Any]:
    import deepshard.engine as ds

    rank, world = mesh.get_rank(), mesh.size()
    results = {}
    for model_name, stage, precision, ga in cases:
        make, batch_of, loss_of = _models.MODELS[model_name]
        dtype = _models.DTYPES[precision]
        model = make()
        config = _models.engine_config(stage=stage, precision=precision, ga=ga)
        engine, _, _, _ = ds.initialize(model, config, mesh=mesh)
        losses, norms = [], []
        for step in range(steps):
            batch = batch_of(step)
            total = 0.0
            for micro in range(ga):
                rows = _models.micro_batch(batch, micro=micro, rank=rank, world=world, ga=ga)
                total += engine.backward(loss_of(engine, rows, dtype)).item()
                engine.step()
            assert engine.was_step_applied()
            losses.append(total)
            norms.append(engine.get_global_grad_norm())
        if precision == "bf16":
            _check_bf16_mechanics(engine)
        params = {n: p.detach().float().clone() for n, p in model.named_parameters()}
        results[(model_name, stage, precision, ga)] = {
            "losses": losses,
            "norms": norms,
            "params": params,
            "steps": engine.global_steps,
        }
    return results


def _check_bf16_mechanics(engine: Any) -> None:
    """bf16 weights, fp32 masters and state, and masters finer than bf16 after training."""
    assert all(p.dtype == torch.bfloat16 for p in engine.module.parameters())
    masters = engine.optimizer.master_partitions
    assert all(m.dtype == torch.float32 for m in masters)
    state = [t for s in engine.optimizer.state.values() for t in s.values() if t.dim()]
    assert state and all(t.dtype == torch.float32 for t in state)
    assert any(not torch.equal(m, m.bfloat16().float()) for m in masters if m.numel())


@pytest.fixture(scope="module")
def references() -> dict[tuple[str, str], dict[str, Any]]:
    return {
        (model, precision): _models.reference(model, precision, STEPS)
        for model in ("mlp", "llama")
        for precision in ("fp32", "bf16")
    }


def _distance(params: dict[str, Any], target: dict[str, Any]) -> float:
    return sum(float((params[n] - target[n]).pow(2).sum()) for n in target) ** 0.5


def _check_params(
    params: dict[str, Any], target: dict[str, Any], ref: dict[str, Any], precision: str, what: str
) -> None:
    """``params`` against ``target`` (the reference's or stage 0's final parameters)."""
    if precision == "fp32":
        for name, expected in target.items():
            error = float((params[name] - expected).norm() / expected.norm())
            assert error <= 1e-5, f"{what}: {name} off by {error:.3g} relative"
        return
    travel = _distance(ref["params"], ref["initial"])
    off = _distance(params, target)
    assert off < 0.3 * travel, f"{what}: distance {off:.3g} vs reference travel {travel:.3g}"


def _check_case(case: Any, per_rank: list[dict[str, Any]], ref: dict[str, Any]) -> None:
    _, _, precision, _ = case
    first = per_rank[0]
    assert first["steps"] == STEPS
    for other in per_rank[1:]:  # every rank holds the same full parameters after the gather
        for name, value in first["params"].items():
            assert torch.equal(other["params"][name], value), f"{case}: ranks differ in {name}"
    losses = torch.tensor([r["losses"] for r in per_rank], dtype=torch.float64).mean(0)
    rtol = 1e-5 if precision == "fp32" else 4 * BF16_U
    expected = torch.tensor(ref["losses"], dtype=torch.float64)
    torch.testing.assert_close(losses, expected, rtol=rtol, atol=0.0, msg=f"{case}: losses")
    norms = torch.tensor(first["norms"], dtype=torch.float64)
    ref_norms = torch.tensor(ref["norms"], dtype=torch.float64)
    compared = slice(None) if precision == "fp32" else slice(0, 1)
    torch.testing.assert_close(norms[compared], ref_norms[compared], rtol=rtol, atol=0.0)
    _check_params(first["params"], ref["params"], ref, precision, f"{case} vs reference")


@pytest.mark.parametrize("world", [1, 2, 4])
def test_every_stage_precision_and_accumulation_matches_the_reference(
    world: int, references: dict[tuple[str, str], dict[str, Any]], tmp_path: Path
) -> None:
    results = run_on_mesh(_train_all, world, args=(CASES, STEPS), store_dir=tmp_path, timeout_s=300)
    for case in CASES:
        model, _, precision, _ = case
        ref = references[(model, precision)]
        assert max(ref["norms"]) > _models.CLIP, "clipping must trigger for the test to bite"
        _check_case(case, [r[case] for r in results], ref)
    for model, precision, ga in itertools.product(("mlp", "llama"), ("fp32", "bf16"), (1, 4)):
        base = results[0][(model, 0, precision, ga)]["params"]
        for stage in (1, 2):
            params = results[0][(model, stage, precision, ga)]["params"]
            what = f"{model} {precision} ga={ga}: stage {stage} vs stage 0"
            _check_params(params, base, references[(model, precision)], precision, what)
