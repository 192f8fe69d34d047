"""Stage-3 offload together with frozen parameters, ``safe_get``/``safe_set``, GatheredParameters
and Muon, on 2 gloo ranks.

A model with a frozen middle weight trains 3 steps with AdamW and clipping four ways:
no offload (the reference), ``offload_optimizer: cpu``, ``cpu`` with ``offload_param: nvme``,
and ``offload_optimizer: nvme`` with ``offload_param: cpu``. Every run must train like the
reference, keep masters only over each unit's trainable prefix (the unit of the frozen weight
has a shorter master than its partition), and:

* with ``cpu`` and ``nvme`` optimizer offload, ``safe_get_full_fp32_param`` / ``exp_avg``
  equal the reference's, and ``safe_set_full_fp32_param`` writes the host master (or its file)
  and the model's partition (read back whole through GatheredParameters);
* in every run a GatheredParameters(modifier_rank=0) write reaches the masters (host, file or
  device), read back through ``master_partitions`` and the parameter's shard info;
* Muon with NVMe optimizer offload is refused with a ConfigError naming
  ``offload_optimizer.device`` (NVMe swaps CPU Adam's state only; Muon with ``cpu`` is
  `test_stage3_muon_offload_matches_device`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from deepshard.testing import import_beside, run_on_mesh

_training = import_beside(__file__, "_training.py")
_muon = import_beside(__file__, "_muon_training.py")

WORLD, STEPS = 2, 3
EAGER = {"max_reuse_distance": 0, "param_persistence_threshold": 0}
RUNS = [("none", "none"), ("cpu", "none"), ("cpu", "nvme"), ("nvme", "cpu")]


def _section(device: str, root: str, **extra: Any) -> dict[str, Any] | None:
    if device == "none":
        return None
    if device == "cpu":
        return {"device": "cpu"}
    return {"device": "nvme", "nvme_path": root, **extra}


def _build(group: Any, opt: str, par: str, root: str, model: Any = None) -> tuple[Any, ...]:
    from deepshard.interface.config import ZeroConfig
    from deepshard.zero import ZeroPolicy, shard

    config = ZeroConfig(
        stage=3,
        offload_optimizer=_section(opt, root),
        offload_param=_section(par, root, buffer_count=2, buffer_size=1000),
    )
    if model is None:
        model = _training.make_model()
        model[2].weight.requires_grad_(False)
    base = ZeroPolicy.from_config(config)
    policy = ZeroPolicy(unit_classes=(torch.nn.Linear,), param_offload=base.param_offload, **EAGER)
    return model, shard(model, group=group, policy=policy), config


def _run(group: Any, rank: int, opt: str, par: str, root: str) -> dict[str, Any]:
    import deepshard.zero as dz

    model, sharded, config = _build(group, opt, par, root)
    trainable = [p for p in model.parameters() if p.requires_grad]
    inner = torch.optim.AdamW(_training.param_groups(trainable), lr=_training.LR)
    zero = dz.ZeroOptimizer(inner, sharded, config=config, gradient_clipping=_training.CLIP)
    mb = _training.GLOBAL_BATCH // WORLD
    for step in range(STEPS):
        x, y = _training.batch(step)
        rows = slice(rank * mb, (rank + 1) * mb)
        zero.backward(_training.loss_fn(model, x[rows], y[rows]))
        if step == STEPS - 1:
            grad = dz.safe_get_full_grad(model[0].weight, zero)
        zero.step()
    out: dict[str, Any] = {
        "grad": grad,
        "params": _gathered(sharded, model),
        "master_numel": [m.numel() for m in zero.master_partitions],
        "partition_numel": [u.plan.layout.partition_numel for u in sharded.units],
    }
    weight = model[0].weight
    out["fp32"] = dz.safe_get_full_fp32_param(weight, zero)
    out["exp_avg"] = dz.safe_get_full_optimizer_state(weight, zero, "exp_avg")
    value = _set_value(tuple(sharded.shard_info(weight).shape))
    dz.safe_set_full_fp32_param(weight, zero, value)
    out["set_fp32"] = dz.safe_get_full_fp32_param(weight, zero)
    with dz.GatheredParameters([weight]):
        out["set_model"] = weight.detach().clone()
    out["modified"], out["master_piece"] = _modify(zero, sharded, model[4].weight)
    return out


def _set_value(shape: tuple[int, ...]) -> torch.Tensor:
    return 0.25 + torch.arange(torch.Size(shape).numel(), dtype=torch.float32).view(shape) * 1e-3


def _gathered(sharded: Any, model: torch.nn.Module) -> list[torch.Tensor]:
    with sharded.gathered():
        return [p.detach().float().clone() for p in model.parameters()]


def _modify(zero: Any, sharded: Any, param: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank 0 writes ``param`` inside GatheredParameters; this rank's master piece after it."""
    import deepshard.zero as dz

    shape = tuple(sharded.shard_info(param).shape)
    value = torch.linspace(-1.0, 1.0, torch.Size(shape).numel()).view(shape)
    with dz.GatheredParameters([param], modifier_rank=0):
        if sharded.group.rank() == 0:
            param.data.copy_(value)
    info = sharded.shard_info(param)
    master = zero.master_partitions[info.unit]
    piece = master[info.local_offset : info.local_offset + info.local_numel].clone()
    return value.reshape(-1)[info.flat_start : info.flat_stop], piece


def _muon_refused(group: Any, root: str) -> str:
    from deepshard.interface.errors import ConfigError
    from deepshard.zero import ZeroOptimizer

    model = _training.make_model()
    muon = _muon.make_muon(model)
    _, sharded, config = _build(group, "nvme", "none", root, model=model)
    try:
        ZeroOptimizer(muon, sharded, config=config, full_grad_transform=_muon.muon_transform,
                      transformed_params=_muon.muon_params(muon))  # fmt: skip
    except ConfigError as error:
        return str(error)
    return "accepted"


def _all(mesh: Any, root: str) -> dict[Any, Any]:
    group, rank = mesh["dp"].get_group(), mesh.get_rank()
    out: dict[Any, Any] = {}
    for opt, par in RUNS:
        path = Path(root) / f"rank{rank}-{opt}-{par}"
        path.mkdir(parents=True, exist_ok=True)
        out[(opt, par)] = _run(group, rank, opt, par, str(path))
    out["muon"] = _muon_refused(group, root)
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[Any, Any]]:
    store = Path(tmp_path_factory.mktemp("store"))
    root = str(tmp_path_factory.mktemp("swap"))
    return run_on_mesh(_all, WORLD, args=(root,), store_dir=store, timeout_s=240)


@pytest.mark.parametrize("run", RUNS[1:])
def test_offload_trains_like_no_offload_with_trainable_prefix_masters(
    results: list[dict[Any, Any]], run: tuple[str, str]
) -> None:
    for rank_results in results:
        ref, got = rank_results[("none", "none")], rank_results[run]
        for a, b in zip(got["params"], ref["params"], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got["grad"], ref["grad"])
        assert got["master_numel"] == ref["master_numel"]
        shorter = [m < p for m, p in zip(got["master_numel"], got["partition_numel"], strict=True)]
        assert any(shorter)  # the frozen weight's unit: no master over it
        torch.testing.assert_close(got["master_piece"], got["modified"], rtol=0, atol=0)


def test_safe_get_and_set_read_and_write_the_host_masters(results: list[dict[Any, Any]]) -> None:
    for rank_results in results:
        ref = rank_results[("none", "none")]
        for run in RUNS[1:]:
            got = rank_results[run]
            torch.testing.assert_close(got["fp32"], ref["fp32"], rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(got["exp_avg"], ref["exp_avg"], rtol=1e-5, atol=1e-7)
            value = _set_value(tuple(ref["fp32"].shape))
            torch.testing.assert_close(got["set_fp32"], value, rtol=0, atol=0)
            torch.testing.assert_close(got["set_model"], value, rtol=0, atol=0)


def test_muon_with_nvme_optimizer_offload_is_refused(results: list[dict[Any, Any]]) -> None:
    for rank_results in results:
        assert "offload_optimizer.device" in rank_results["muon"]
        assert "offload_optimizer" in rank_results["muon"] and "Muon" in rank_results["muon"]
