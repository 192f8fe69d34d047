"""``save_checkpoint`` after 5 steps, ``load_checkpoint`` into a fresh engine, 5 more steps:
bit-identical to 10 uninterrupted steps, at ZeRO stages 0-3 × world 1 and 2 (and stage 3 at
world 4), bf16 at stage 2, Muon (its momentum is ZeRO's full-gradient buffer) at stages 2-3,
CPU optimizer offload at stage 2 and parameter + optimizer offload at stage 3 (the host masters
and moments, and an fp32 host partition that is its own master).

The run is everything resume must restore: the engine's own data loader (its position in the
epoch), dropout (torch's CPU generator), input noise from Python's `random`, a WarmupLR
schedule, AdamW's moments and step, the counters. The resumed engine is built from other
weights and the generators are re-seeded before the load, so nothing is equal by accident.
``client_state`` (JSON and a tensor) comes back. ``load_optimizer_states=False`` gives the saved
weights, counters and schedule with a fresh optimizer; ``load_module_only=True`` the weights
alone.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from deepshard.testing import run_on_mesh

pytestmark = pytest.mark.slow  # the main run covers it; the package env keeps a few lighter ones

SIZES = (13, 37, 29, 7)
SAMPLES = 160
GLOBAL_BATCH = 16
STEPS, SAVE_AT = 10, 5


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(SIZES[0], SIZES[1]),
        torch.nn.Tanh(),
        torch.nn.Dropout(0.2),
        torch.nn.Linear(SIZES[1], SIZES[2]),
        torch.nn.Tanh(),
        torch.nn.Linear(SIZES[2], SIZES[3]),
    )


def _data() -> torch.utils.data.TensorDataset:
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(SAMPLES, SIZES[0], generator=gen)
    return torch.utils.data.TensorDataset(x, 3 * torch.randn(SAMPLES, SIZES[-1], generator=gen))


def _offload(precision: str) -> dict[str, Any]:
    """``fp32-offload-opt``: the optimizer on the host; ``-all``: the parameters too."""
    if not precision.startswith("fp32-offload"):
        return {}
    section = {"offload_optimizer": {"device": "cpu", "pin_memory": False}}
    if precision == "fp32-offload-all":
        section["offload_param"] = {"device": "cpu", "pin_memory": False}
    return section


def _engine(mesh: Any, stage: int, precision: str, seed: int) -> Any:
    import deepshard.engine as ds

    config = {
        "train_batch_size": GLOBAL_BATCH,
        "gradient_clipping": 0.5,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}}
        if precision != "fp32-muon"
        else {"type": "Muon", "params": {"muon_lr": 0.02, "adam_lr": 1e-2, "momentum": 0.95}},
        "scheduler": {
            "type": "WarmupLR",
            "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-2, "warmup_num_steps": 8},
        },
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 500, **_offload(precision)},
        "bf16": {"enabled": precision == "bf16"},
    }
    engine, _, _, _ = ds.initialize(_model(seed), config, training_data=_data(), mesh=mesh)
    return engine


def _train(engine: Any, batches: Any, steps: int) -> list[float]:
    losses = []
    for _ in range(steps):
        x, y = next(batches)
        x = x + 1e-2 * random.random()
        dtype = next(engine.module.parameters()).dtype
        loss = F.mse_loss(engine(x.to(dtype)).float(), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def _weights(engine: Any) -> dict[str, torch.Tensor]:
    return {k: v.float().clone() for k, v in engine.module_state_dict().items()}


def _fresh_state(engine: Any) -> bool:
    inner = engine.optimizer.inner
    return all(not s for s in inner.state.values())


def _case(mesh: Any, root: str, stage: int, precision: str, extra: bool) -> dict[str, Any]:
    random.seed(0)
    straight = _engine(mesh, stage, precision, seed=0)
    losses = _train(straight, iter(straight.training_dataloader), STEPS)
    out: dict[str, Any] = {"straight": losses, "weights": _weights(straight)}
    straight.destroy()

    random.seed(0)
    first = _engine(mesh, stage, precision, seed=0)
    _train(first, iter(first.training_dataloader), SAVE_AT)
    saved = _weights(first)
    client = {"note": "five steps", "scores": [1, 2.5], "t": torch.arange(3.0)}
    first.save_checkpoint(root, client_state=client)
    first.destroy()

    random.seed(99)
    resumed = _engine(mesh, stage, precision, seed=1)
    path, client_back = resumed.load_checkpoint(root)
    out["path"], out["client"], out["steps_at_load"] = path, client_back, resumed.global_steps
    out["resumed"] = _train(resumed, iter(resumed.training_dataloader), STEPS - SAVE_AT)
    out["resumed_weights"] = _weights(resumed)
    resumed.destroy()
    if extra:
        fresh_opt = _engine(mesh, stage, precision, seed=2)
        fresh_opt.load_checkpoint(root, load_optimizer_states=False)
        out["no_opt"] = (_weights(fresh_opt), fresh_opt.global_steps, fresh_opt.get_lr())
        out["no_opt_fresh"] = _fresh_state(fresh_opt)
        fresh_opt.destroy()
        module_only = _engine(mesh, stage, precision, seed=3)
        initial_lr = module_only.get_lr()
        module_only.load_checkpoint(root, load_module_only=True)
        out["module_only"] = (_weights(module_only), module_only.global_steps)
        out["module_only_lr"] = (initial_lr, module_only.get_lr())
        out["module_only_fresh"] = _fresh_state(module_only)
        module_only.destroy()
    out["saved_weights"] = saved
    return out


def _run(mesh: Any, root: str, cases: list[tuple[int, str, bool]]) -> dict[Any, Any]:
    return {
        case: _case(mesh, f"{root}/s{case[0]}-{case[1]}", *case)
        for case in cases
    }  # fmt: skip


def _check(per_rank: list[dict[Any, Any]], world: int) -> None:
    for case, out in per_rank[0].items():
        stage, precision, extra = case
        what = f"world {world} stage {stage} {precision}"
        for rank_out in per_rank:
            r = rank_out[case]
            assert r["resumed"] == r["straight"][SAVE_AT:], f"{what}: losses differ after resume"
            for name, value in r["weights"].items():
                assert torch.equal(r["resumed_weights"][name], value), f"{what}: {name} differs"
            assert r["steps_at_load"] == SAVE_AT
        assert Path(out["path"]).name == f"global_step{SAVE_AT}"
        client = out["client"]
        assert client["note"] == "five steps" and client["scores"] == [1, 2.5]
        assert torch.equal(client["t"], torch.arange(3.0))
        if extra:
            weights, steps, lrs = out["no_opt"]
            assert all(torch.equal(weights[n], v) for n, v in out["saved_weights"].items())
            assert steps == SAVE_AT and out["no_opt_fresh"], f"{what}: optimizer state loaded"
            assert lrs != out["module_only_lr"][0], "the schedule was not restored"
            weights, steps = out["module_only"]
            assert all(torch.equal(weights[n], v) for n, v in out["saved_weights"].items())
            assert steps == 0 and out["module_only_fresh"], f"{what}: more than the module"
            initial_lr, after = out["module_only_lr"]
            assert after == initial_lr, f"{what}: load_module_only moved the schedule"


def test_resume_is_exact_at_world_1(tmp_path: Path) -> None:
    cases = [(0, "fp32", False), (1, "fp32", False), (2, "fp32", True), (3, "fp32", False)]
    per_rank = run_on_mesh(_run, 1, args=(str(tmp_path / "ck"), cases), store_dir=tmp_path)
    _check(per_rank, 1)


def test_resume_is_exact_at_world_2(tmp_path: Path) -> None:
    cases = [
        (0, "fp32", False),
        (1, "fp32", False),
        (2, "fp32", True),
        (3, "fp32", True),
        (2, "bf16", False),
        (2, "fp32-muon", False),
        (3, "fp32-muon", False),
        (2, "fp32-offload-opt", False),
        (3, "fp32-offload-all", False),
    ]
    per_rank = run_on_mesh(
        _run, 2, args=(str(tmp_path / "ck"), cases), store_dir=tmp_path, timeout_s=280
    )
    _check(per_rank, 2)


def test_resume_is_exact_at_world_4_stage3(tmp_path: Path) -> None:
    per_rank = run_on_mesh(
        _run, 4, args=(str(tmp_path / "ck"), [(3, "fp32", False)]), store_dir=tmp_path,
        timeout_s=280,
    )  # fmt: skip
    _check(per_rank, 4)
