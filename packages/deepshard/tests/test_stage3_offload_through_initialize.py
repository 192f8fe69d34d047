"""Stage 3 with ``offload_optimizer: cpu`` and ``offload_param: nvme`` through ``initialize``.

2 ranks, the engine tests' MLP (one unit, the root), fp32, `STEPS` AdamW steps with clipping,
against the single-process reference (`_models.reference`, the bounds of
``test_stage3_through_initialize``: the host step is DeepShard's CPU Adam kernel). The engine
reads both sections from the config (and ``aio``); its memory report then counts no parameter
bytes on the device, the partitions are in files between steps, and ``destroy()`` removes the
swap directories.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from deepshard.testing import import_beside, run_on_mesh

pytestmark = pytest.mark.slow  # the main run covers it; the package env keeps a few lighter ones

_models = import_beside(__file__, "_models.py")

STEPS = 4


def _train(mesh: Any, root: str) -> dict[str, Any]:
    import deepshard.engine as ds

    rank, world = mesh.get_rank(), mesh.size()
    make, batch_of, loss_of = _models.MODELS["mlp"]
    model = make()
    zero = {
        "stage": 3,
        "offload_optimizer": {"device": "cpu"},
        "offload_param": {"device": "nvme", "nvme_path": root},
    }
    config = _models.engine_config(
        stage=3, precision="fp32", ga=1, zero_optimization=zero, aio={"block_size": 4096}
    )
    engine, optimizer, _, _ = ds.initialize(model, config, mesh=mesh)
    losses = []
    for step in range(STEPS):
        rows = _models.micro_batch(batch_of(step), micro=0, rank=rank, world=world, ga=1)
        losses.append(engine.backward(loss_of(engine, rows, torch.float32)).item())
        engine.step()
    sharded = optimizer.sharded_module
    in_files = [u.partition.untyped_storage().nbytes() for u in sharded.units]
    memory = engine.memory_bytes()
    with sharded.gathered():
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
    before = sorted(p.name for p in Path(root).glob(f"zero3-params-pid{os.getpid()}-*"))
    engine.destroy()
    after = sorted(p.name for p in Path(root).glob(f"zero3-params-pid{os.getpid()}-*"))
    return {
        "losses": losses,
        "params": params,
        "in_files": in_files,
        "param_bytes": memory.parameters,
        "dirs": (len(before), len(after)),
    }


def test_stage3_offload_through_initialize_matches_single_process(tmp_path: Path) -> None:
    root = tmp_path / "nvme"
    root.mkdir()
    per_rank = run_on_mesh(_train, 2, args=(str(root),), store_dir=tmp_path, timeout_s=120)
    ref = _models.reference("mlp", "fp32", STEPS)
    for i in range(STEPS):
        got = sum(r["losses"][i] for r in per_rank) / 2
        assert abs(got - ref["losses"][i]) <= 1e-5 * abs(ref["losses"][i]), i
    for name, want in ref["params"].items():
        got = per_rank[0]["params"][name]
        assert float((got - want).norm() / want.norm()) <= 1e-5, name
    for r in per_rank:
        assert r["in_files"] == [0] * len(r["in_files"])  # no partition bytes in memory
        assert r["param_bytes"] == 0
        assert r["dirs"] == (1, 0)
    assert list(root.iterdir()) == []
