"""``initialize`` at ZeRO stage 3 with ``optimizer: {type: Muon}``, and the engine's
``safe_get_*`` / ``safe_set_*`` methods at stage 3, on 2 ranks against one process.

* Muon: the engine tests' MLP trained with the config of `test_muon_through_initialize.py`
  (two of its ``model_parameters`` variants, clipping off) at stage 3, against that test's
  single-process reference (plain Muon with the groups written out by hand); same bound,
  ``||p - p_ref|| / ||p_ref|| <= 1e-4`` per tensor; the first variant also with
  ``offload_optimizer: cpu`` (Newton–Schulz on the device, Muon stepping the host masters: no
  master shares a unit partition's storage, as the fp32 masters on the device do).
* safe_get/safe_set with AdamW: after the first backward, ``engine.safe_get_full_grad`` of
  every parameter is the whole-batch gradient of one process; after the step,
  ``safe_get_full_fp32_param`` and ``safe_get_full_optimizer_state(.., "exp_avg")`` are the
  parameters and moments of ``torch.optim.AdamW`` after ``clip_grad_norm_``; a value set with
  ``safe_set_full_fp32_param`` is read back and is what the model holds.
* ``stage3_model_persistence_threshold`` from the config reaches the sharded model's policy and
  is no longer reported as ignored.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from deepshard.testing import import_beside, run_on_mesh

pytestmark = pytest.mark.slow  # the main run covers it; the package env keeps a few lighter ones

_models = import_beside(__file__, "_models.py")
_muon = import_beside(__file__, "test_muon_through_initialize.py")

MUON_VARIANTS = ("default", "groups")


def _muon_train(mesh: Any, variant: str, offload: bool = False) -> list[torch.Tensor]:
    import deepshard.engine as ds

    rank, world = mesh.get_rank(), mesh.size()
    model = _models.make_mlp()
    zero: dict[str, Any] = {"stage": 3}
    if offload:
        zero["offload_optimizer"] = {"device": "cpu"}
    config = _models.engine_config(stage=3, precision="fp32", ga=1, zero_optimization=zero)
    config.update(optimizer={"type": "Muon", "params": _muon.MUON}, gradient_clipping=0.0)
    params = _muon._model_parameters(model, variant)
    engine, optimizer, _, _ = ds.initialize(model, config, model_parameters=params, mesh=mesh)
    assert optimizer.stage == 3
    units = optimizer.sharded_module.units
    pairs = zip(optimizer.master_partitions, units, strict=True)
    ptr = [(m.untyped_storage().data_ptr(), u.partition.untyped_storage().data_ptr())
           for m, u in pairs if u.plan.params]  # fmt: skip
    # fp32 on the device: each partition is its own master; offloaded: host masters apart
    assert all(a == b for a, b in ptr) != offload and all(a != b for a, b in ptr) == offload
    for step in range(_muon.STEPS):
        rows = _models.micro_batch(_models.mlp_batch(step), micro=0, rank=rank, world=world, ga=1)
        engine.backward(_models.mlp_loss(engine, rows, torch.float32))
        engine.step()
    with optimizer.sharded_module.gathered():
        return [p.detach().clone() for p in model.parameters()]


def _safe_get_set(mesh: Any) -> dict[str, Any]:
    import deepshard.engine as ds
    from deepshard.interface import DeepShardConfig
    from deepshard.interface.status import ignored_keys

    rank, world = mesh.get_rank(), mesh.size()
    model = _models.make_mlp()
    zero = {"stage": 3, "stage3_model_persistence_threshold": 5}
    config = _models.engine_config(stage=3, precision="fp32", ga=1, zero_optimization=zero)
    engine, optimizer, _, _ = ds.initialize(model, config, mesh=mesh)
    params = list(model.parameters())
    rows = _models.micro_batch(_models.mlp_batch(0), micro=0, rank=rank, world=world, ga=1)
    engine.backward(_models.mlp_loss(engine, rows, torch.float32))
    grads = [engine.safe_get_full_grad(p) for p in params]
    engine.step()
    fp32 = [engine.safe_get_full_fp32_param(p) for p in params]
    exp_avg = [engine.safe_get_full_optimizer_state(p, "exp_avg") for p in params]
    shape = optimizer.sharded_module.shard_info(params[0]).shape
    value = torch.linspace(-1, 1, int(torch.Size(shape).numel())).view(shape)
    engine.safe_set_full_fp32_param(params[0], value)
    with optimizer.sharded_module.gathered():
        model_value = params[0].detach().clone()
    return {
        "grads": grads,
        "fp32": fp32,
        "exp_avg": exp_avg,
        "set": (engine.safe_get_full_fp32_param(params[0]), model_value, value),
        "model_threshold": optimizer.sharded_module.policy.model_persistence_threshold,
        "ignored": ignored_keys(DeepShardConfig.from_dict(config)),
    }


def _all(mesh: Any) -> dict[str, Any]:
    out: dict[str, Any] = {v: _muon_train(mesh, v) for v in MUON_VARIANTS}
    out["offload"] = _muon_train(mesh, MUON_VARIANTS[0], offload=True)
    out["safe"] = _safe_get_set(mesh)
    return out


def _adamw_reference() -> dict[str, list[torch.Tensor]]:
    model = _models.make_mlp()
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=_models.LR, weight_decay=_models.WEIGHT_DECAY)
    _models.mlp_loss(model, _models.mlp_batch(0), torch.float32).backward()
    grads = [p.grad.clone() for p in params]
    torch.nn.utils.clip_grad_norm_(params, _models.CLIP)
    opt.step()
    exp_avg = [opt.state[p]["exp_avg"].clone() for p in params]
    return {"grads": grads, "fp32": [p.detach().clone() for p in params], "exp_avg": exp_avg}


def test_muon_and_safe_get_at_stage3_through_initialize(tmp_path: Path) -> None:
    ranks = run_on_mesh(_all, 2, store_dir=tmp_path, timeout_s=180)
    for variant, key in (*((v, v) for v in MUON_VARIANTS), (MUON_VARIANTS[0], "offload")):
        expected = _muon._reference(variant)
        for rank_results in ranks:
            for got, want in zip(rank_results[key], expected, strict=True):
                error = float((got - want).norm() / want.norm())
                assert error <= 1e-4, f"{variant}: off by {error:.3g} relative"
    ref = _adamw_reference()
    for rank_results in ranks:
        safe = rank_results["safe"]
        for key in ("grads", "fp32", "exp_avg"):
            for got, want in zip(safe[key], ref[key], strict=True):
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        read, model_value, value = safe["set"]
        assert torch.equal(read, value) and torch.equal(model_value, value)
        assert safe["model_threshold"] == 5
        assert "zero_optimization.stage3_model_persistence_threshold" not in safe["ignored"]
