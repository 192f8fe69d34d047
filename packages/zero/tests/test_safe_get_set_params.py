"""The ``safe_get_*`` / ``safe_set_*`` functions agree with a single-process reference, stages 0-2.

On 2 gloo ranks the odd-sized MLP trains two steps under ZeRO (AdamW, clipping) while the parent
runs the reference (`_training.reference`'s recipe) on the whole batch:

* after step 0's backward, ``safe_get_full_grad`` of every parameter equals the reference's
  gradient (before clipping), and is ``None`` once the step consumed it;
* after step 0, ``safe_get_full_fp32_param`` and ``safe_get_full_optimizer_state(.., "exp_avg")``
  equal the reference's parameters and AdamW ``exp_avg``;
* then the weight of layer 0 is set with ``safe_set_full_fp32_param``, layer 1's ``exp_avg`` with
  ``safe_set_full_optimizer_state``, and every rank doubles its own piece of layer 2's weight with
  ``safe_set_local_fp32_param``; the reference sets the same values on its parameters and state,
  and step 1 (its gradients, and the final parameters) still agree;
* every local getter returns the rank's slice of the full tensor per its shard map.

In bf16 the fp32 master read back is the bf16 parameter exactly, and a set value lands in the
master as is and in the model rounded to bf16. Then the bad inputs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from deepshard.testing import import_beside, run_on_mesh

_training = import_beside(__file__, "_training.py")

STAGES = (0, 1, 2)


def _value(shape: tuple[int, ...], scale: float) -> torch.Tensor:
    """A deterministic value unrelated to training."""
    return torch.linspace(-scale, scale, steps=int(torch.Size(shape).numel())).view(shape)


def _zero(group: Any, stage: int, dtype: torch.dtype) -> tuple[Any, Any]:
    from deepshard.interface.config import ZeroConfig
    from deepshard.zero import ZeroOptimizer

    model = _training.make_model(dtype)
    inner = torch.optim.AdamW(_training.param_groups(list(model.parameters())), lr=_training.LR)
    config = ZeroConfig(stage=stage, reduce_bucket_size=600)
    zero = ZeroOptimizer(
        inner,
        group=group,
        config=config,
        gradient_clipping=_training.CLIP,
        named_parameters=model.named_parameters(),
    )
    return model, zero


def _locals(zero: Any, params: list[torch.Tensor], rank: int) -> dict[str, Any]:
    import deepshard.zero as dz

    return {
        "spans": [
            [(p.flat_start, p.stop) for p in zero.param_shard_map(q).pieces_of(rank)]
            for q in params
        ],
        "fp32": [dz.safe_get_local_fp32_param(q, zero) for q in params],
        "exp_avg": [dz.safe_get_local_optimizer_state(q, zero, "exp_avg") for q in params],
    }


def _train(group: Any, rank: int, stage: int) -> dict[str, Any]:
    import deepshard.zero as dz

    model, zero = _zero(group, stage, torch.float32)
    params = list(model.parameters())
    world, mb = group.size(), _training.GLOBAL_BATCH // group.size()
    out: dict[str, Any] = {}
    for step in range(2):
        x, y = _training.batch(step)
        rows = slice(rank * mb, (rank + 1) * mb)
        zero.backward(_training.loss_fn(model, x[rows], y[rows]))
        out[f"grads{step}"] = [dz.safe_get_full_grad(p, zero) for p in params]
        out[f"local_grads{step}"] = [dz.safe_get_local_grad(p, zero) for p in params]
        zero.step()
        out[f"grads_after_step{step}"] = [dz.safe_get_full_grad(p, zero) for p in params]
        if step == 0:
            out["fp32"] = [dz.safe_get_full_fp32_param(p, zero) for p in params]
            out["exp_avg"] = [dz.safe_get_full_optimizer_state(p, zero, "exp_avg") for p in params]
            out["locals"] = _locals(zero, params, group.get_local_rank())
            dz.safe_set_full_fp32_param(params[0], zero, _value(params[0].shape, 1.0))
            dz.safe_set_full_optimizer_state(
                params[2], zero, _value(params[2].shape, 1e-2), "exp_avg"
            )
            piece = dz.safe_get_local_fp32_param(params[4], zero)
            dz.safe_set_local_fp32_param(params[4], zero, 2 * piece)
            out["set_fp32"] = dz.safe_get_full_fp32_param(params[0], zero)
            out["set_model"] = params[0].detach().clone()
    out["final"] = [p.detach().clone() for p in params]
    assert world == 2
    return out


def _bf16(group: Any, stage: int) -> dict[str, Any]:
    import deepshard.zero as dz

    model, zero = _zero(group, stage, torch.bfloat16)
    weight = model[2].weight
    before = dz.safe_get_full_fp32_param(weight, zero)
    initial = weight.detach().float().clone()
    value = _value(weight.shape, 0.3)
    dz.safe_set_full_fp32_param(weight, zero, value)
    return {
        "read_is_param": torch.equal(before, initial),
        "master_is_value": torch.equal(dz.safe_get_full_fp32_param(weight, zero), value),
        "model_is_rounded": torch.equal(weight.detach(), value.to(torch.bfloat16)),
    }


def _bad_input(group: Any) -> dict[str, Any]:
    import deepshard.zero as dz
    from deepshard.interface.errors import CommError, ConfigError

    model, zero = _zero(group, 2, torch.float32)
    weight = model[0].weight
    found: dict[str, Any] = {
        "frozen": dz.safe_get_full_fp32_param(torch.nn.Parameter(torch.ones(3), False), zero)
    }
    calls = {
        "foreign": lambda: dz.safe_get_full_fp32_param(torch.nn.Parameter(torch.ones(3)), zero),
        "no_state": lambda: dz.safe_get_full_optimizer_state(weight, zero, "exp_avg"),
        "shape": lambda: dz.safe_set_full_fp32_param(weight, zero, torch.ones(5)),
        "grad_outside": lambda: dz.safe_set_full_grad(weight, zero, torch.ones(weight.shape)),
    }
    for name, call in calls.items():
        try:
            call()
        except (ConfigError, CommError) as error:
            found[name] = f"{type(error).__name__}: {error}"
    x, y = _training.batch(0)
    zero.backward(_training.loss_fn(model, x, y))
    zero.step()
    try:
        dz.safe_get_full_optimizer_state(weight, zero, "exp_avgx")
    except ConfigError as error:
        found["bad_key"] = str(error)
    return found


def _all(mesh: Any) -> dict[str, Any]:
    group, rank = mesh["dp"], mesh.get_rank()
    return {
        "train": {stage: _train(group, rank, stage) for stage in STAGES},
        "bf16": {stage: _bf16(group, stage) for stage in STAGES},
        "bad": _bad_input(group),
    }


def _reference() -> dict[str, Any]:
    """Two fp32 steps on the whole batch with the same sets between them."""
    model = _training.make_model(torch.float32)
    params = list(model.parameters())
    inner = torch.optim.AdamW(_training.param_groups(params), lr=_training.LR)
    out: dict[str, Any] = {}
    for step in range(2):
        x, y = _training.batch(step)
        model.zero_grad()
        _training.loss_fn(model, x, y).backward()
        out[f"grads{step}"] = [p.grad.clone() for p in params]
        torch.nn.utils.clip_grad_norm_(params, _training.CLIP)
        inner.step()
        if step == 0:
            out["fp32"] = [p.detach().clone() for p in params]
            out["exp_avg"] = [inner.state[p]["exp_avg"].clone() for p in params]
            with torch.no_grad():
                params[0].copy_(_value(params[0].shape, 1.0))
                inner.state[params[2]]["exp_avg"].copy_(_value(params[2].shape, 1e-2))
                params[4].mul_(2)
    out["final"] = [p.detach().clone() for p in params]
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    store = Path(tmp_path_factory.mktemp("store"))
    return run_on_mesh(_all, 2, store_dir=store, timeout_s=180)


def _close(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    for a, b in zip(got, want, strict=True):
        assert a.shape == b.shape and a.dtype == torch.float32
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("stage", STAGES)
def test_full_getters_and_setters_match_reference(
    results: list[dict[str, Any]], stage: int
) -> None:
    ref = _reference()
    for rank_results in results:
        got = rank_results["train"][stage]
        for key in ("grads0", "grads1", "fp32", "exp_avg", "final"):
            _close(got[key], ref[key])
        assert got["grads_after_step0"] == [None] * 6 and got["grads_after_step1"] == [None] * 6
        assert torch.equal(got["set_fp32"], _value((37, 13), 1.0))
        assert torch.equal(got["set_model"], _value((37, 13), 1.0))


@pytest.mark.parametrize("stage", STAGES)
def test_local_getters_give_the_ranks_slice(results: list[dict[str, Any]], stage: int) -> None:
    held = [0] * 6
    for rank_results in results:
        got = rank_results["train"][stage]
        spans = got["locals"]["spans"]
        for i, rank_spans in enumerate(spans):
            held[i] += sum(stop - start for start, stop in rank_spans)
            for kind, full in (("fp32", got["fp32"][i]), ("exp_avg", got["exp_avg"][i])):
                want = [torch.zeros(0)] + [full.reshape(-1)[a:b] for a, b in rank_spans]
                assert torch.equal(got["locals"][kind][i], torch.cat(want)), (kind, i)
            grads = [torch.zeros(0)] + [got["grads0"][i].reshape(-1)[a:b] for a, b in rank_spans]
            want_grad = torch.cat(grads)
            assert torch.equal(got["local_grads0"][i], want_grad)
    numels = [p.numel() for p in _training.make_model().parameters()]
    # stage 0: both ranks hold everything; stages 1-2: the pieces partition each parameter
    assert held == [n * (2 if stage == 0 else 1) for n in numels]


@pytest.mark.parametrize("stage", STAGES)
def test_bf16_masters_and_model_copy(results: list[dict[str, Any]], stage: int) -> None:
    for rank_results in results:
        assert rank_results["bf16"][stage] == dict.fromkeys(
            ("read_is_param", "master_is_value", "model_is_rounded"), True
        )


def test_bad_input(results: list[dict[str, Any]]) -> None:
    for rank_results in results:
        bad = rank_results["bad"]
        assert bad["frozen"] is None
        assert bad["foreign"].startswith("ConfigError") and "does not train" in bad["foreign"]
        assert "none yet" in bad["no_state"]
        assert "481 elements (shape (37, 13)), got (5,)" in bad["shape"]
        assert bad["grad_outside"].startswith("CommError") and "step()" in bad["grad_outside"]
        assert "['exp_avg', 'exp_avg_sq']" in bad["bad_key"]
