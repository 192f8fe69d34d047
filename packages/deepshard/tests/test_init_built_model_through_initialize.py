"""A model built under `deepshard.zero.Init` trains through ``initialize`` like one process.

2 ranks: the engine tests' MLP built under ``Init(config=config, mesh=mesh)`` (fp32, ZeRO
stage 3, gradient accumulation 1 and 2, and accumulation 1 with ``offload_param: {device:
nvme}``, whose slices `Init` keeps in files from construction on); ``initialize`` must use
the `ShardedModule` ``Init`` built (found through the model's hooks) rather than shard again,
and `STEPS` AdamW steps with clipping match the single-process reference
(`_models.reference`) within the stage-3 engine test's bounds (losses 1e-5 relative,
parameters ``||p - p_ref|| / ||p_ref|| <= 1e-5``).
An Init-built model under a stage-2 config, under a bf16 config while its partitions are fp32,
or with other stage-3 knobs than the config's is refused with the key to fix.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from deepshard.interface.errors import ConfigError
from deepshard.testing import import_beside, run_on_mesh

pytestmark = pytest.mark.slow  # the main run covers it; the package env keeps a few lighter ones

_models = import_beside(__file__, "_models.py")

STEPS = 3
RUNS = ((1, False), (2, False), (1, True))  # (accumulation, NVMe parameter offload)


def _config(ga: int, nvme: bool, root: str) -> dict[str, Any]:
    config = _models.engine_config(stage=3, precision="fp32", ga=ga)
    if nvme:
        section = {"device": "nvme", "nvme_path": root, "buffer_size": 10_000}
        config["zero_optimization"] = {"stage": 3, "offload_param": section}
    return config


def _train(mesh: Any, root: str) -> dict[Any, Any]:
    import deepshard.engine as ds
    from deepshard.zero import Init, sharded_module_of

    make, batch_of, loss_of = _models.MODELS["mlp"]
    rank, world = mesh.get_rank(), mesh.size()
    results: dict[Any, Any] = {}
    for ga, nvme in RUNS:
        config = _config(ga, nvme, root)
        with Init(config=config, mesh=mesh):
            model = make()
        built = sharded_module_of(model)
        if nvme:  # the partitions are in files, not memory
            assert all(u.partition.untyped_storage().nbytes() == 0 for u in built.units)
        engine, optimizer, _, _ = ds.initialize(model, config, mesh=mesh)
        assert optimizer.sharded_module is built and engine.module is model
        losses = []
        for step in range(STEPS):
            total = 0.0
            for micro in range(ga):
                rows = _models.micro_batch(
                    batch_of(step), micro=micro, rank=rank, world=world, ga=ga
                )
                total += engine.backward(loss_of(engine, rows, torch.float32)).item()
                engine.step()
            losses.append(total)
        with built.gathered():
            results[ga, nvme] = {
                "losses": losses,
                "params": {n: p.detach().clone() for n, p in model.named_parameters()},
            }
    results["refused"] = _refusals(mesh)
    return results


def _refusals(mesh: Any) -> list[str]:
    import deepshard.engine as ds
    from deepshard.zero import Init

    make = _models.MODELS["mlp"][0]
    stage3 = _models.engine_config(stage=3, precision="fp32", ga=1)
    cases = [
        (stage3, _models.engine_config(stage=2, precision="fp32", ga=1)),
        (stage3, _models.engine_config(stage=3, precision="bf16", ga=1)),
        (stage3, {**stage3, "zero_optimization": {"stage": 3, "reduce_bucket_size": 1000}}),
    ]
    messages = []
    for built_with, trained_with in cases:
        with Init(config=built_with, mesh=mesh):
            model = make()
        try:
            ds.initialize(model, trained_with, mesh=mesh)
            messages.append("no error")
        except ConfigError as error:
            messages.append(str(error))
    return messages


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def test_init_built_model_trains_through_initialize(tmp_path: Path) -> None:
    root = tmp_path / "nvme"
    root.mkdir()
    per_rank = run_on_mesh(_train, 2, args=(str(root),), store_dir=tmp_path)
    ref = _models.reference("mlp", "fp32", STEPS)
    for run in RUNS:
        for i in range(STEPS):
            got = sum(r[run]["losses"][i] for r in per_rank) / 2
            assert abs(got - ref["losses"][i]) <= 1e-5 * abs(ref["losses"][i]), (run, i)
        for name, want in ref["params"].items():
            got = per_rank[0][run]["params"][name]
            assert _rel(got, want) <= 1e-5, (run, name)
            assert torch.equal(got, per_rank[1][run]["params"][name])
    for r in per_rank:
        stage, dtype, knobs = r["refused"]
        assert "zero_optimization.stage" in stage and "Init" in stage
        assert "Init(dtype=)" in dtype and "bfloat16" in dtype
        assert "zero_optimization" in knobs and "reduce_bucket_size" in knobs
