"""``bf16.bf16_master_weights_and_grads`` with ``bf16_optimizer_states`` at ZeRO stages 1-3.

The masters, the reduced gradients and the Adam moments are all bf16, so a step is exactly what
torch's AdamW does to a bf16 model on its own. On one rank the engine must therefore match that
reference bit for bit at stages 1-3 (losses and weights, 4 steps; stage 3 also with its
partitions offloaded to the host), with the unpartitioned bf16 buffer (stage 3: the bf16
partition on the device) serving as its own master (no copy). A checkpoint taken
after 2 steps, loaded into a fresh engine, gives the same last 2 steps. On 2 gloo ranks (each on
half the batch) the weights follow the same reference within bf16 rounding (the two halves'
gradients are averaged, not computed at once), and each rank's ZeRO state (masters + both
moments) takes half the bytes of the fp32-master run of the same config. Configs DeepShard
cannot honour are refused with the key named. A checkpoint saved with bf16 masters loads into
an fp32-master engine exactly, and one saved with fp32 masters loads into a bf16 one rounded.

DeepSpeed's other mode, bf16 masters with fp32 moments stepped on the host by CPU Adam
(``offload_optimizer: cpu`` without ``bf16_optimizer_states``), must equal DeepShard's own
AdamW (the same kernel, fp32 moments) on a bf16 model bit for bit at stages 1-3, with the host
holding 2 + 4 + 4 bytes per master element.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from deepshard.interface import ConfigError, DeepShardConfig
from deepshard.testing import run_on_mesh

STEPS, MICRO, LR = 4, 4, 1e-2


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


def _batch(step: int, rank: int, micro: int = MICRO) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * step + rank)
    x, y = torch.randn(micro, 6, generator=gen), torch.randn(micro, 3, generator=gen)
    return x.bfloat16(), y.bfloat16()


def _loss(model: Any, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return torch.nn.functional.mse_loss(model(x), y)


def _config(stage: int, world: int, *, bf16_masters: bool = True) -> dict[str, Any]:
    return {
        "train_batch_size": MICRO * world,
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_clipping": 0.0,
        "bf16": {
            "enabled": True,
            "bf16_master_weights_and_grads": bf16_masters,
            "bf16_optimizer_states": bf16_masters,
        },
        "zero_optimization": {"stage": stage},
    }


def _engine(mesh: Any, config: dict[str, Any]) -> Any:
    import deepshard.engine as ds

    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    engine, *_ = ds.initialize(model, config, optimizer=optimizer, mesh=mesh)
    return engine


def _steps(engine: Any, rank: int, steps: range) -> list[float]:
    losses = []
    for step in steps:
        loss = _loss(engine, _batch(step, rank))
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach().float()))
    return losses


def _state_bytes(engine: Any) -> dict[str, Any]:
    masters = list(engine.optimizer.master_partitions)
    moments = _moments(engine)
    return {
        "dtypes": sorted({str(t.dtype) for t in masters + moments}),
        "bytes": sum(t.numel() * t.element_size() for t in masters + moments),
        "master_numel": sum(t.numel() for t in masters),
    }


def _params(engine: Any, stage: int) -> dict[str, torch.Tensor]:
    from deepshard.zero import GatheredParameters

    named = dict(engine.module.named_parameters())
    if stage < 3:
        return {n: p.detach().clone() for n, p in named.items()}
    with GatheredParameters(list(named.values())):
        return {n: p.detach().clone() for n, p in named.items()}


def _own_buffer(engine: Any, stage: int) -> torch.Tensor:
    if stage == 3:
        return engine.optimizer.sharded.units[0].partition
    return engine.optimizer._flat[0].buffer


def _one_rank(mesh: Any, stage: int, offload_param: bool, folder: str) -> dict[str, Any]:
    config = _config(stage, 1)
    if offload_param:  # the partitions live on the host: the master is a device copy
        config["zero_optimization"]["offload_param"] = {"device": "cpu"}
    engine = _engine(mesh, config)
    own = _own_buffer(engine, stage)
    aliased = engine.optimizer.master_partitions[0].data_ptr() == own.data_ptr()
    losses = _steps(engine, 0, range(STEPS))
    params = _params(engine, stage)
    # Resume: 2 steps, save, a fresh engine loads and runs the last 2.
    first = _engine(mesh, config)
    _steps(first, 0, range(2))
    first.save_checkpoint(folder)
    second = _engine(mesh, config)
    second.load_checkpoint(folder)
    resumed = _steps(second, 0, range(2, STEPS))
    after = _params(second, stage)
    return {
        "losses": losses,
        "params": params,
        "aliased": aliased,
        "state": _state_bytes(engine),
        "resumed": resumed,
        "after": after,
    }


def _alone(model: torch.nn.Module, opt: torch.optim.Optimizer, ranks: int = 1) -> dict[str, Any]:
    """`STEPS` steps of ``opt`` on ``model`` in this process, on the batches of ``ranks`` ranks
    at once: the losses and the weights."""
    losses = []
    for step in range(STEPS):
        x, y = zip(*(_batch(step, rank) for rank in range(ranks)), strict=True)
        loss = _loss(model, (torch.cat(x), torch.cat(y)))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach().float()))
    return {"losses": losses, "params": {n: p.detach() for n, p in model.named_parameters()}}


def _reference(ranks: int) -> dict[str, Any]:
    model = _model().bfloat16()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    out = _alone(model, opt, ranks)
    states = [t for s in opt.state.values() for k, t in s.items() if k != "step"]
    assert {t.dtype for t in states} == {torch.bfloat16}  # torch's moments follow the params
    return out


@pytest.mark.parametrize(
    ("stage", "offload_param"), [(1, False), (2, False), (3, False), (3, True)]
)
def test_one_rank_steps_exactly_as_adamw_on_a_bf16_model(
    stage: int, offload_param: bool, tmp_path: Path
) -> None:
    args = (stage, offload_param, str(tmp_path / "ckpt"))
    [out] = run_on_mesh(_one_rank, 1, args=args, timeout_s=120)
    ref = _reference(1)
    assert out["losses"] == ref["losses"]
    for name, value in ref["params"].items():
        assert out["params"][name].dtype == torch.bfloat16
        torch.testing.assert_close(out["params"][name], value, rtol=0, atol=0)
        torch.testing.assert_close(out["after"][name], value, rtol=0, atol=0)
    assert out["resumed"] == ref["losses"][2:]
    assert out["aliased"] is not offload_param  # a device-resident bf16 buffer is its own master
    assert out["state"]["dtypes"] == ["torch.bfloat16"]
    # master + two moments, 2 bytes an element; the master covers every parameter, plus at most
    # 7 elements of alignment padding each (16-byte alignment at stages 1-2)
    numel, count = out["state"]["master_numel"], len(ref["params"])
    total = sum(p.numel() for p in ref["params"].values())
    assert total <= numel <= total + 7 * count
    assert out["state"]["bytes"] == numel * 2 * 3


def _two_ranks(mesh: Any, stage: int) -> dict[str, Any]:
    rank = mesh.get_rank()
    engine = _engine(mesh, _config(stage, 2))
    losses = _steps(engine, rank, range(STEPS))
    params = _params(engine, stage)
    fp32 = _engine(mesh, _config(stage, 2, bf16_masters=False))
    _steps(fp32, rank, range(1))  # the moments exist after a step
    return {
        "losses": losses,
        "params": params,
        "state": _state_bytes(engine),
        "fp32_state": _state_bytes(fp32),
    }


def _both_stages(mesh: Any) -> dict[int, Any]:
    return {stage: _two_ranks(mesh, stage) for stage in (1, 2, 3)}


@pytest.mark.slow  # 2 gloo ranks, six engines; the main run has it
def test_two_ranks_follow_the_reference_with_half_the_state() -> None:
    ranks = run_on_mesh(_both_stages, 2, timeout_s=180)
    ref = _reference(2)
    for rank, by_stage in enumerate(ranks):
        for stage, out in by_stage.items():
            for name, value in ref["params"].items():
                torch.testing.assert_close(
                    out["params"][name], value, rtol=2e-2, atol=2e-2,
                    msg=lambda m, s=stage, r=rank, n=name: f"stage {s}, rank {r}, {n}: {m}",
                )  # fmt: skip
            assert out["state"]["dtypes"] == ["torch.bfloat16"]
            assert out["fp32_state"]["dtypes"] == ["torch.float32"]
            assert out["state"]["bytes"] * 2 == out["fp32_state"]["bytes"], (rank, stage)
    # both ranks hold the same (replicated) weights after the all-gather
    for stage in (1, 2, 3):
        for name in ref["params"]:
            assert torch.equal(ranks[0][stage]["params"][name], ranks[1][stage]["params"][name])


def _refused_initialize(mesh: Any) -> str:
    """The error of an ``initialize`` DeepShard refuses: an optimizer keeping fp32 moments while
    the config asks for bf16 ones."""
    import deepshard.engine as ds
    from deepshard.optimizers import AdamW

    model = _model()
    optimizer = AdamW(model.parameters(), lr=LR, fp32_optimizer_states=True)
    with pytest.raises(ConfigError) as caught:
        ds.initialize(model, _config(2, 1), optimizer=optimizer, mesh=mesh)
    return str(caught.value)


def _refused_muon_fp16(mesh: Any) -> str:
    """The error of Muon with fp16 masters (stepped only by the CPU Adam kernel)."""
    import deepshard.engine as ds

    config = {
        "train_batch_size": MICRO,
        "fp16": {"enabled": True, "fp16_master_weights_and_grads": True},
        "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}},
        "optimizer": {"type": "Muon", "params": MUON},
    }
    with pytest.raises(ConfigError) as caught:
        ds.initialize(_model(), config, mesh=mesh)
    return str(caught.value)


MUON = {"lr": 0.02, "momentum": 0.95, "weight_decay": 0.1}


def _config_built(mesh: Any, stage: int, kind: str) -> dict[str, Any]:
    """The engine building its optimizer from the config (DeepShard's AdamW or Muon, whose
    moments default to fp32) under ``bf16_optimizer_states``."""
    import deepshard.engine as ds

    params = MUON if kind == "Muon" else {"lr": LR, "weight_decay": 0.01}
    config = _config(stage, 1) | {"optimizer": {"type": kind, "params": params}}
    engine, *_ = ds.initialize(_model(), config, mesh=mesh)
    losses = _steps(engine, 0, range(STEPS))
    states = engine.optimizer.inner.state.values()
    floats = {str(t.dtype) for s in states for t in s.values() if torch.is_tensor(t) and t.ndim}
    return {"losses": losses, "params": _params(engine, stage), "state_dtypes": sorted(floats)}


def _config_built_reference(kind: str) -> dict[str, Any]:
    from deepshard.optimizers import AdamW, Muon

    model = _model().bfloat16()
    if kind == "Muon":
        named = list(model.named_parameters())
        opt: torch.optim.Optimizer = Muon(named, **MUON, fp32_optimizer_states=False)
    else:
        opt = AdamW(model.parameters(), lr=LR, weight_decay=0.01, fp32_optimizer_states=False)
    return _alone(model, opt)


@pytest.mark.slow  # four one-rank engines; the main run has them
@pytest.mark.parametrize(("stage", "kind"), [(1, "AdamW"), (3, "AdamW"), (1, "Muon"), (2, "Muon")])
def test_config_built_optimizers_keep_bf16_states(stage: int, kind: str) -> None:
    """DeepShard's AdamW and Muon keep fp32 moments by default; under ``bf16_optimizer_states``
    the engine builds them with 16-bit ones. AdamW is bit-exact with the same optimizer on a bf16
    model; Muon within two bf16 steps after 4 steps (ZeRO hands Muon's finished update over in
    the gradient buffer, bf16 here, where plain Muon adds it unrounded)."""
    [out] = run_on_mesh(_config_built, 1, args=(stage, kind), timeout_s=120)
    ref = _config_built_reference(kind)
    assert out["state_dtypes"] == ["torch.bfloat16"]
    ulps = 2.0**-6 if kind == "Muon" else 0.0  # 2 steps of bf16's 8 significant bits
    torch.testing.assert_close(out["losses"], ref["losses"], rtol=ulps, atol=0)
    for name, value in ref["params"].items():
        torch.testing.assert_close(out["params"][name], value, rtol=ulps, atol=0)


def _problems(**bf16: Any) -> str:
    zero = bf16.pop("zero", {"stage": 2})
    config = {"train_batch_size": 2, "bf16": {"enabled": True} | bf16, "zero_optimization": zero}
    with pytest.raises(ConfigError) as caught:
        DeepShardConfig.from_dict(config)
    return str(caught.value)


def test_configs_it_cannot_honour_are_refused_by_key() -> None:
    key = "bf16.bf16_master_weights_and_grads"
    masters = {"bf16_master_weights_and_grads": True}
    both = masters | {"bf16_optimizer_states": True}
    message = _problems(**masters)
    assert key in message and "bf16_optimizer_states: true" in message
    offload = {"stage": 2, "offload_optimizer": {"device": "cpu"}}
    assert "needs bf16.enabled" in _problems(enabled=False, **both)
    assert "stage >= 1" in _problems(**both, zero={"stage": 0})
    # refused once the model and optimizer exist: a caller's optimizer keeping fp32 moments,
    # and Muon with fp16 masters
    own, muon = (
        run_on_mesh(refused, 1, timeout_s=60)[0]
        for refused in (_refused_initialize, _refused_muon_fp16)
    )
    assert "bf16.bf16_optimizer_states" in own and "fp32_optimizer_states=False" in own
    assert "fp16.fp16_master_weights_and_grads" in muon and "does not run with Muon" in muon
    # the supported combinations validate
    for bf16, zero in ((both, {"stage": 1}), (masters, offload), (both, offload)):
        DeepShardConfig.from_dict(
            {"train_batch_size": 2, "bf16": {"enabled": True} | bf16, "zero_optimization": zero}
        )


def _switch_precision(mesh: Any, folder: str, saved_bf16: bool) -> dict[str, Any]:
    first = _engine(mesh, _config(2, 1, bf16_masters=saved_bf16))
    _steps(first, 0, range(2))
    first.save_checkpoint(folder)
    saved = [m.detach().clone() for m in first.optimizer.master_partitions]
    moments = [t.detach().clone() for t in _moments(first)]
    second = _engine(mesh, _config(2, 1, bf16_masters=not saved_bf16))
    second.load_checkpoint(folder)
    return {
        "saved": saved,
        "loaded": [m.detach().clone() for m in second.optimizer.master_partitions],
        "moments": moments,
        "loaded_moments": [t.detach().clone() for t in _moments(second)],
    }


def _moments(engine: Any) -> list[torch.Tensor]:
    state = engine.optimizer.inner.state.values()
    return [t for s in state for k, t in sorted(s.items()) if k.startswith("exp_avg")]


@pytest.mark.slow  # two pairs of one-rank engines; the main run has them
@pytest.mark.parametrize("saved_bf16", [True, False])
def test_a_checkpoint_loads_across_master_precisions(saved_bf16: bool, tmp_path: Path) -> None:
    """Saved with bf16 masters, loaded with fp32 ones (exact), and the other way (rounded)."""
    args = (str(tmp_path / "ckpt"), saved_bf16)
    [out] = run_on_mesh(_switch_precision, 1, args=args, timeout_s=120)
    masters = zip(out["saved"], out["loaded"], strict=True)
    pairs = [*masters, *zip(out["moments"], out["loaded_moments"], strict=True)]
    assert len(pairs) == 1 + 2  # one unit's master; the two moments of its one master view
    for saved, loaded in pairs:
        assert saved.dtype != loaded.dtype
        assert torch.equal(loaded, saved.to(loaded.dtype))


def _muon_offloaded(mesh: Any, states: bool) -> dict[str, Any]:
    """Config-built Muon at stage 3 with its partitions offloaded (Muon steps the host masters
    itself, Newton-Schulz having run on the device on the whole reduced gradient)."""
    import deepshard.engine as ds

    config = _config(3, 1) | {"optimizer": {"type": "Muon", "params": MUON}}
    config["bf16"]["bf16_optimizer_states"] = states
    config["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    engine, *_ = ds.initialize(_model(), config, mesh=mesh)
    losses = _steps(engine, 0, range(STEPS))
    host = engine.optimizer.inner.param_groups
    moments = [
        t
        for s in engine.optimizer.inner.state.values()
        for k, t in s.items()
        if k.startswith("exp_avg")
    ]
    return {
        "losses": losses,
        "params": _params(engine, 3),
        "masters": sorted({f"{p.device.type} {p.dtype}" for g in host for p in g["params"]}),
        "moments": sorted({str(t.dtype) for t in moments}),
        "host_step": engine.optimizer._offload is not None,
    }


@pytest.mark.slow  # two one-rank engines; the main run has them
@pytest.mark.parametrize("states", [True, False])
def test_muon_steps_offloaded_bf16_masters(states: bool) -> None:
    """Muon with bf16 masters on the host: its Adam half keeps bf16 moments under
    ``bf16_optimizer_states`` and fp32 ones without (DeepSpeed's CPU-offload mode), and 4 steps
    follow plain Muon on a bf16 model with the same moments within two bf16 steps, as on the
    device."""
    from deepshard.optimizers import Muon

    [out] = run_on_mesh(_muon_offloaded, 1, args=(states,), timeout_s=120)
    model = _model().bfloat16()
    named = list(model.named_parameters())
    ref = _alone(model, Muon(named, **MUON, fp32_optimizer_states=not states))
    assert out["host_step"] and out["masters"] == ["cpu torch.bfloat16"]
    assert out["moments"] == ["torch.bfloat16" if states else "torch.float32"]
    ulps = 2.0**-6
    torch.testing.assert_close(out["losses"], ref["losses"], rtol=ulps, atol=0)
    for name, value in ref["params"].items():
        torch.testing.assert_close(out["params"][name], value, rtol=ulps, atol=0)


# --- DeepSpeed's other mode: bf16 masters with fp32 moments, stepped on the host -------------


def _offloaded(mesh: Any, stage: int, offload: dict[str, Any], states: bool) -> dict[str, Any]:
    config = _config(stage, 1)
    config["bf16"]["bf16_optimizer_states"] = states
    config["zero_optimization"]["offload_optimizer"] = offload
    engine = _engine(mesh, config)
    losses = _steps(engine, 0, range(STEPS))
    offload = engine.optimizer._offload
    masters, exp_avg, exp_avg_sq = offload.state.whole()
    return {
        "losses": losses,
        "params": _params(engine, stage),
        "dtypes": [str(t[0].dtype) for t in (masters, exp_avg, exp_avg_sq)],
        "host_bytes": sum(t.numel() * t.element_size() for t in [*masters, *exp_avg, *exp_avg_sq]),
        "master_numel": sum(t.numel() for t in masters),
    }


def _kernel_reference(states: bool = False) -> dict[str, Any]:
    """DeepShard's AdamW on a bf16 model in one process: fp32 moments by default (bf16 with
    ``states``), the same CPU kernel the offloaded step runs."""
    from deepshard.optimizers import AdamW

    model = _model().bfloat16()
    # torch AdamW's default decay; 16-bit moments when the config asks for bf16 states
    opt = AdamW(model.parameters(), lr=LR, weight_decay=0.01, fp32_optimizer_states=not states)
    out = _alone(model, opt)
    moments = [t for s in opt.state.values() for k, t in s.items() if k.startswith("exp_avg")]
    assert {t.dtype for t in moments} == {torch.bfloat16 if states else torch.float32}
    return out


@pytest.mark.slow  # seven one-rank engines; the main run has them
@pytest.mark.parametrize(
    ("stage", "device", "states"),
    [(1, "cpu", False), (2, "cpu", False), (3, "cpu", False), (2, "nvme", False),
     (3, "nvme", False), (2, "cpu", True), (3, "nvme", True)],
)  # fmt: skip
def test_offloaded_bf16_masters_step_like_the_kernel(
    stage: int, device: str, states: bool, tmp_path: Path
) -> None:
    offload = {"device": device} | ({"nvme_path": str(tmp_path)} if device == "nvme" else {})
    [out] = run_on_mesh(_offloaded, 1, args=(stage, offload, states), timeout_s=120)
    ref = _kernel_reference(states)
    assert out["losses"] == ref["losses"]
    for name, value in ref["params"].items():
        torch.testing.assert_close(out["params"][name], value, rtol=0, atol=0)
    moment = "torch.bfloat16" if states else "torch.float32"
    assert out["dtypes"] == ["torch.bfloat16", moment, moment]
    per_element = 2 + 2 * (2 if states else 4)  # the fp32-master run: 4 + 4 + 4
    assert out["host_bytes"] == out["master_numel"] * per_element


def _partial(mesh: Any) -> dict[str, Any]:
    offload = {"device": "cpu", "ratio": 0.5}
    zero_config = {"sub_group_size": 40}  # several sub-groups: some on the device, some not
    config = _config(3, 1)
    config["bf16"]["bf16_optimizer_states"] = False
    config["zero_optimization"] |= zero_config | {"offload_optimizer": offload}
    engine = _engine(mesh, config)
    losses = _steps(engine, 0, range(STEPS))
    share = engine.optimizer._offload.device_share
    return {
        "losses": losses,
        "params": _params(engine, 3),
        "device_masters": sorted({str(m.dtype) for m in share.masters}),
        "device_subs": len(share.sub_groups),
        "host_subs": len(engine.optimizer._offload.sub_groups),
    }


@pytest.mark.slow  # a one-rank engine; the main run has it
def test_a_partial_offload_keeps_bf16_masters_on_both_sides() -> None:
    """ratio 0.5 at stage 3: the device share steps its bf16 masters with the kernel's formula
    in torch operations (widened to fp32, rounded once), the rest is the kernel: within one
    bf16 rounding step of the all-kernel reference."""
    [out] = run_on_mesh(_partial, 1, timeout_s=120)
    ref = _kernel_reference()
    assert out["device_subs"] > 0 and out["host_subs"] > 0
    assert out["device_masters"] == ["torch.bfloat16"]
    for name, value in ref["params"].items():
        assert out["params"][name].dtype == torch.bfloat16
        torch.testing.assert_close(out["params"][name], value, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(out["losses"], ref["losses"], rtol=1e-2, atol=0)


# --- fp16 masters (DeepSpeed: with CPU optimizer offload only) -------------------------------

SCALE = 128.0  # a static loss scale: no overflow skips, the same unscaling in the reference


def _fp16_offloaded(mesh: Any, stage: int) -> dict[str, Any]:
    import deepshard.engine as ds

    config = {
        "train_batch_size": MICRO,
        "gradient_clipping": 0.0,
        "fp16": {"enabled": True, "loss_scale": SCALE, "fp16_master_weights_and_grads": True},
        "zero_optimization": {"stage": stage, "offload_optimizer": {"device": "cpu"}},
    }
    model = _model()
    engine, *_ = ds.initialize(
        model, config, optimizer=torch.optim.AdamW(model.parameters(), lr=LR), mesh=mesh
    )
    losses = []
    for step in range(STEPS):
        x, y = (t.half() for t in _batch(step, 0))
        loss = _loss(engine, (x, y))
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach().float()))
    masters, exp_avg, exp_avg_sq = engine.optimizer._offload.state.whole()
    return {
        "losses": losses,
        "params": _params(engine, stage),
        "dtypes": [str(t[0].dtype) for t in (masters, exp_avg, exp_avg_sq)],
    }


def _fp16_reference() -> dict[str, Any]:
    """DeepShard's AdamW (fp32 moments, the CPU kernel) on an fp16 model, the loss scaled by
    `SCALE` in fp32 as the engine scales it and the fp16 gradients unscaled in place."""
    from deepshard.optimizers import AdamW

    model = _model().half()
    opt = AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    losses = []
    for step in range(STEPS):
        x, y = (t.half() for t in _batch(step, 0))
        loss = _loss(model, (x, y))
        (loss.float() * SCALE).backward()
        for param in model.parameters():
            assert param.grad is not None
            param.grad.mul_(1.0 / SCALE)
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach().float()))
    return {"losses": losses, "params": {n: p.detach() for n, p in model.named_parameters()}}


@pytest.mark.slow  # three one-rank engines; the main run has them
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_fp16_masters_step_on_the_host_like_the_kernel(stage: int) -> None:
    [out] = run_on_mesh(_fp16_offloaded, 1, args=(stage,), timeout_s=120)
    ref = _fp16_reference()
    assert out["losses"] == ref["losses"]
    for name, value in ref["params"].items():
        assert out["params"][name].dtype == torch.float16
        torch.testing.assert_close(out["params"][name], value, rtol=0, atol=0)
    assert out["dtypes"] == ["torch.float16", "torch.float32", "torch.float32"]


def test_fp16_masters_need_fp16_and_cpu_offload() -> None:
    key = "fp16.fp16_master_weights_and_grads"

    def problems(fp16: dict[str, Any], zero: dict[str, Any]) -> str:
        config = {"train_batch_size": 2, "fp16": fp16, "zero_optimization": zero}
        with pytest.raises(ConfigError) as caught:
            DeepShardConfig.from_dict(config)
        return str(caught.value)

    on = {"enabled": True, "fp16_master_weights_and_grads": True}
    cpu = {"stage": 2, "offload_optimizer": {"device": "cpu"}}
    assert key in problems(on, {"stage": 2}) and '{"device": "cpu"}' in problems(on, {"stage": 2})
    assert "needs fp16.enabled" in problems(on | {"enabled": False}, cpu)
    DeepShardConfig.from_dict({"train_batch_size": 2, "fp16": on, "zero_optimization": cpu})
