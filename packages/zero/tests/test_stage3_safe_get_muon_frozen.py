"""Stage 3 on 2 ranks: ``safe_get_*`` / ``safe_set_*``, Muon, frozen parameters, persistence.

One ``run_on_mesh`` call; every case is checked against a single-process reference computed
here, on the odd-sized MLP of `_training` with each ``Linear`` a unit (parameters straddle the
rank boundary inside every unit):

* **safe_get / safe_set**: the recipe of `test_safe_get_set_params.py` (its reference): the
  full gradient after step 0's backward, the fp32 parameters and AdamW ``exp_avg`` after step 0,
  three setters between the steps, step 1's gradients and the final parameters; the local
  getters give each rank's slice per its shard map; bf16 masters and the model copy; bad input.
* **Muon** (`_muon_training`'s reference, clipping on): Newton–Schulz once per step on each
  matrix's whole reduced gradient, accumulation 1 and 4; its momentum is in ``state_dict`` and a
  run restored from step 3's state dict ends bit-identical to the uninterrupted one.
* **A frozen weight** inside a trainable unit: no master elements and no optimizer state for
  it (counted over both ranks against the trainable sizes), it stays bit-identical, and the
  rest trains like the reference.
* **``stage3_model_persistence_threshold``** caps the persistent units.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch

from deepshard.interface.config import ZeroConfig
from deepshard.interface.errors import ConfigError
from deepshard.testing import import_beside, run_on_mesh
from deepshard.zero import ZeroPolicy

_training = import_beside(__file__, "_training.py")
_muon = import_beside(__file__, "_muon_training.py")
_safe = import_beside(__file__, "test_safe_get_set_params.py")

EAGER = {"max_reuse_distance": 0, "param_persistence_threshold": 0}
FROZEN_STEPS = 3


def _sharded(model: torch.nn.Module, group: Any, **policy: Any) -> Any:
    from deepshard.zero import shard

    units = ZeroPolicy(unit_classes=(torch.nn.Linear,), **{**EAGER, **policy})
    return shard(model, group=group, policy=units)


def _adamw_stage3(group: Any, dtype: torch.dtype) -> tuple[Any, Any, Any]:
    from deepshard.zero import ZeroOptimizer

    model = _training.make_model(dtype)
    trainable = [p for p in model.parameters() if p.requires_grad]
    inner = torch.optim.AdamW(_training.param_groups(trainable), lr=_training.LR)
    sharded = _sharded(model, group)
    zero = ZeroOptimizer(
        inner, sharded, config=ZeroConfig(stage=3), gradient_clipping=_training.CLIP
    )
    return model, sharded, zero


def _gathered(sharded: Any, model: torch.nn.Module) -> list[torch.Tensor]:
    with sharded.gathered():
        return [p.detach().float().clone() for p in model.parameters()]


def _safe_get_set(group: Any, rank: int) -> dict[str, Any]:
    import deepshard.zero as dz

    model, sharded, zero = _adamw_stage3(group, torch.float32)
    params = list(model.parameters())
    shapes = [sharded.shard_info(p).shape for p in params]  # released: .shape is (0,)
    mb = _training.GLOBAL_BATCH // group.size()
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
            out["locals"] = _safe._locals(zero, params, rank)
            dz.safe_set_full_fp32_param(params[0], zero, _safe._value(shapes[0], 1.0))
            dz.safe_set_full_optimizer_state(
                params[2], zero, _safe._value(shapes[2], 1e-2), "exp_avg"
            )
            piece = dz.safe_get_local_fp32_param(params[4], zero)
            dz.safe_set_local_fp32_param(params[4], zero, 2 * piece)
            out["set_fp32"] = dz.safe_get_full_fp32_param(params[0], zero)
            out["set_model"] = _gathered(sharded, model)[0]
    out["final"] = _gathered(sharded, model)
    return out


def _bf16_and_bad_input(group: Any) -> dict[str, Any]:
    import deepshard.zero as dz
    from deepshard.interface.errors import CommError

    model, sharded, zero = _adamw_stage3(group, torch.bfloat16)
    weight = model[2].weight
    initial = _gathered(sharded, model)[2]
    before = dz.safe_get_full_fp32_param(weight, zero)
    value = _safe._value(tuple(initial.shape), 0.3)
    with sharded.gathered():  # a gathered unit sees the value at once
        dz.safe_set_full_fp32_param(weight, zero, value)
        model_now = weight.detach().clone()
    found: dict[str, Any] = {
        "read_is_param": torch.equal(before, initial),
        "master_is_value": torch.equal(dz.safe_get_full_fp32_param(weight, zero), value),
        "model_is_rounded": torch.equal(model_now, value.to(torch.bfloat16))
        and torch.equal(_gathered(sharded, model)[2], value.to(torch.bfloat16).float()),
        "frozen": dz.safe_get_full_fp32_param(torch.nn.Parameter(torch.ones(3), False), zero),
    }
    calls = {
        "foreign": lambda: dz.safe_get_full_fp32_param(torch.nn.Parameter(torch.ones(3)), zero),
        "no_state": lambda: dz.safe_get_full_optimizer_state(weight, zero, "exp_avg"),
        "shape": lambda: dz.safe_set_full_fp32_param(weight, zero, torch.ones(5)),
        "grad_outside": lambda: dz.safe_set_full_grad(weight, zero, torch.ones(29, 37)),
    }
    for name, call in calls.items():
        try:
            call()
        except (ConfigError, CommError) as error:
            found[name] = f"{type(error).__name__}: {error}"
    return found


def _muon_stage3(group: Any, ga: int, steps: int, state: Any = None) -> dict[str, Any]:
    from deepshard.zero import ZeroOptimizer

    rank, world = group.rank(), group.size()
    model = _training.make_model()
    muon = _muon.make_muon(model)  # built on the whole parameters: its halves see real shapes
    sharded = _sharded(model, group, reduce_bucket_size=300)
    zero = ZeroOptimizer(
        muon,
        sharded,
        config=ZeroConfig(stage=3),
        gradient_clipping=_muon.CLIP,
        full_grad_transform=_muon.muon_transform,
        transformed_params=_muon.muon_params(muon),
    )
    first = 0
    if state is not None:
        first = state["step"]
        zero.load_state_dict(state["zero"])
    norms, saved = [], None
    for step in range(first, steps):
        for micro in range(ga):
            x, y = _muon.micro_batch(step, rank, world, ga, micro)
            zero.backward(_training.loss_fn(model, x, y) / ga, is_boundary=micro == ga - 1)
        result = zero.step()
        norms.append(result.grad_norm)
        if step == 2:
            saved = {"step": 3, "zero": copy.deepcopy(zero.state_dict())}
    buffers = sorted(zero.state_dict()["full_grad_buffers"])
    return {"norms": norms, "params": _gathered(sharded, model), "saved": saved,
            "buffers": buffers}  # fmt: skip


def _frozen(group: Any, rank: int) -> dict[str, Any]:
    from deepshard.zero import ZeroOptimizer

    model = _training.make_model()
    model[2].weight.requires_grad_(False)
    trainable = [p for p in model.parameters() if p.requires_grad]
    inner = torch.optim.AdamW(_training.param_groups(trainable), lr=_training.LR)
    sharded = _sharded(model, group)
    zero = ZeroOptimizer(
        inner, sharded, config=ZeroConfig(stage=3), gradient_clipping=_training.CLIP
    )
    mb = _training.GLOBAL_BATCH // group.size()
    for step in range(FROZEN_STEPS):
        x, y = _training.batch(step)
        zero.backward(
            _training.loss_fn(model, x[rank * mb : (rank + 1) * mb], y[rank * mb : (rank + 1) * mb])
        )
        zero.step()
    state_numel = sum(s["exp_avg"].numel() for s in inner.state.values())
    return {
        "params": _gathered(sharded, model),
        "master_numel": [m.numel() for m in zero.master_partitions],
        "state_numel": state_numel,
    }


def _persistence(group: Any) -> dict[str, Any]:
    from deepshard.zero import ZeroOptimizer

    model = _training.make_model()
    # units: root (0 elements), 518, 1102, 210; persistent: ≤ 10_000 each, ≤ 600 together
    sharded = _sharded(model, group, param_persistence_threshold=10_000,
                       model_persistence_threshold=600)  # fmt: skip
    zero = ZeroOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), sharded,
                         config=ZeroConfig(stage=3))  # fmt: skip
    x, y = _training.batch(0)
    zero.backward(_training.loss_fn(model, x, y))
    zero.step()
    with torch.no_grad():
        model(x)
    return {"resident": sorted(sharded.fetcher.resident),
            "gathered": [sharded.is_gathered(model[i]) for i in (0, 2, 4)]}  # fmt: skip


def _all(mesh: Any) -> dict[str, Any]:
    group, rank = mesh["dp"].get_group(), mesh.get_rank()
    full = _muon_stage3(group, 1, _muon.STEPS)
    return {
        "safe": _safe_get_set(group, rank),
        "bf16_bad": _bf16_and_bad_input(group),
        "muon": full,
        "muon_ga4": _muon_stage3(group, 4, _muon.STEPS),
        "muon_resumed": _muon_stage3(group, 1, _muon.STEPS, state=full["saved"]),
        "frozen": _frozen(group, rank),
        "persistence": _persistence(group),
    }


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    store = Path(tmp_path_factory.mktemp("store"))
    return run_on_mesh(_all, 2, store_dir=store, timeout_s=240)


def test_safe_get_and_set_match_reference(results: list[dict[str, Any]]) -> None:
    ref = _safe._reference()
    held = [0] * 6
    for rank_results in results:
        got = rank_results["safe"]
        for key in ("grads0", "grads1", "fp32", "exp_avg", "final"):
            _safe._close(got[key], ref[key])
        assert got["grads_after_step0"] == [None] * 6 and got["grads_after_step1"] == [None] * 6
        assert torch.equal(got["set_fp32"], _safe._value((37, 13), 1.0))
        assert torch.equal(got["set_model"], _safe._value((37, 13), 1.0))
        spans = got["locals"]["spans"]
        for i, rank_spans in enumerate(spans):
            held[i] += sum(stop - start for start, stop in rank_spans)
            for kind, whole in (("fp32", got["fp32"][i]), ("exp_avg", got["exp_avg"][i])):
                want = [torch.zeros(0)] + [whole.reshape(-1)[a:b] for a, b in rank_spans]
                assert torch.equal(got["locals"][kind][i], torch.cat(want)), (kind, i)
            grad = [torch.zeros(0)] + [got["grads0"][i].reshape(-1)[a:b] for a, b in rank_spans]
            assert torch.equal(got["local_grads0"][i], torch.cat(grad))
    assert held == [p.numel() for p in _training.make_model().parameters()]  # a partition


def test_bf16_masters_model_copy_and_bad_input(results: list[dict[str, Any]]) -> None:
    for rank_results in results:
        bad = rank_results["bf16_bad"]
        assert bad["read_is_param"] and bad["master_is_value"] and bad["model_is_rounded"]
        assert bad["frozen"] is None
        assert bad["foreign"].startswith("ConfigError") and "sharded module" in bad["foreign"]
        assert "none yet" in bad["no_state"]
        assert "1073 elements (shape (29, 37)), got (5,)" in bad["shape"]
        assert bad["grad_outside"].startswith("CommError") and "step()" in bad["grad_outside"]


def test_muon_at_stage3_matches_single_process_muon(results: list[dict[str, Any]]) -> None:
    ref = _muon.reference()
    assert min(ref["norms"]) > _muon.CLIP  # clipping is exercised at every step
    for key in ("muon", "muon_ga4"):
        per_rank = [r[key] for r in results]
        for other in per_rank[1:]:
            assert all(
                torch.equal(a, b)
                for a, b in zip(other["params"], per_rank[0]["params"], strict=True)
            )
        got = per_rank[0]
        assert _rel(torch.tensor(got["norms"]), torch.tensor(ref["norms"])) < 1e-5, key
        for p, r in zip(got["params"], ref["params"], strict=True):
            assert _rel(p, r) < 1e-5, key
    # momentum per matrix a rank holds a piece of (2 ranks, each matrix cut in two)
    assert [r["muon"]["buffers"] for r in results] == [["0.weight", "2.weight", "4.weight"]] * 2
    for r in results:  # resumed from step 3's state dict: bit-identical
        assert all(
            torch.equal(a, b)
            for a, b in zip(r["muon_resumed"]["params"], r["muon"]["params"], strict=True)
        )


def _frozen_reference() -> list[torch.Tensor]:
    model = _training.make_model()
    model[2].weight.requires_grad_(False)
    trainable = [p for p in model.parameters() if p.requires_grad]
    inner = torch.optim.AdamW(_training.param_groups(trainable), lr=_training.LR)
    for step in range(FROZEN_STEPS):
        x, y = _training.batch(step)
        inner.zero_grad()
        _training.loss_fn(model, x, y).backward()
        torch.nn.utils.clip_grad_norm_(trainable, _training.CLIP)
        inner.step()
    return [p.detach().clone() for p in model.parameters()]


def test_frozen_weight_has_no_master_nor_state(results: list[dict[str, Any]]) -> None:
    ref = _frozen_reference()
    initial = _training.initial_params(torch.float32)
    for r in results:
        got = r["frozen"]
        assert torch.equal(got["params"][2], initial[2])
        for p, want in zip(got["params"], ref, strict=True):
            assert _rel(p, want) < 1e-5
    # trainable: 481 + 37 (unit 0.*), 29 (2.bias), 203 + 7 (unit 4.*); fp32 aligns to 4
    # elements, so a unit's trainable prefix is 484 + 37, 29 and 204 + 7 elements
    masters = [sum(r["frozen"]["master_numel"][u] for r in results) for u in range(4)]
    assert masters == [0, 521, 29, 211]  # root, then units; the frozen 1073 are not there
    assert sum(r["frozen"]["state_numel"] for r in results) == 481 + 37 + 29 + 203 + 7


def test_model_persistence_threshold_caps_persistent_units(results: list[dict[str, Any]]) -> None:
    for r in results:
        assert r["persistence"] == {"resident": [0, 1], "gathered": [True, False, False]}
    policy = ZeroPolicy(param_persistence_threshold=100, model_persistence_threshold=150)
    # 80 fits; 200 is over the per-unit limit; 60 brings the total to 140; 50 would pass 150;
    # 10 still fits (150)
    assert policy.resident_units([0, 80, 200, 60, 50, 10]) == {0, 1, 3, 5}
    config = ZeroConfig.model_validate({"stage": 3, "stage3_model_persistence_threshold": 5})
    assert ZeroPolicy.from_config(config).model_persistence_threshold == 5
    with pytest.raises(ConfigError, match="stage3_model_persistence_threshold"):
        ZeroPolicy(model_persistence_threshold=-1)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())
