"""``offload_optimizer`` through ``initialize``: NVMe offload trains like one process.

One 2-rank run trains the odd-sized MLP at stage 2 (fp32, 2 accumulation steps, torch's AdamW
from the config, clipping that triggers) with the optimizer state in NVMe swap files under a
temporary ``nvme_path`` (sub-groups of 300 elements, read ahead and written behind), and
compares losses, gradient norms and final parameters with the single-process reference
(`_models.reference`) at the bounds of `test_deepshard_adamw_under_zero` (1e-5 relative: the
host step is DeepShard's CPU Adam kernel, the same formula in another order). The rank's swap
directory exists during training and is gone after ``engine.destroy()``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from deepshard.testing import import_beside, run_on_mesh

pytestmark = pytest.mark.slow  # the main run covers it; the package env keeps a few lighter ones

_models = import_beside(__file__, "_models.py")
STEPS = 4
GA = 2
WORLD = 2


def _train(mesh: Any, root: str) -> dict[str, Any]:
    import deepshard.engine as ds

    rank, world = mesh.get_rank(), mesh.size()
    model = _models.make_mlp()
    offload = {"device": "nvme", "nvme_path": root, "pipeline_read": True, "pipeline_write": True}
    config = _models.engine_config(stage=2, precision="fp32", ga=GA)
    config["zero_optimization"].update(offload_optimizer=offload, sub_group_size=300)
    config["aio"] = {"block_size": 4096, "queue_depth": 4}
    engine, _, _, _ = ds.initialize(model, config, mesh=mesh)
    losses, norms = [], []
    for step in range(STEPS):
        batch = _models.mlp_batch(step)
        total = 0.0
        for micro in range(GA):
            rows = _models.micro_batch(batch, micro=micro, rank=rank, world=world, ga=GA)
            total += engine.backward(_models.mlp_loss(engine, rows, torch.float32)).item()
            engine.step()
        losses.append(total)
        norms.append(engine.get_global_grad_norm())
    directory = engine.optimizer._offload.state.swapper.directory
    during = sorted(p.name for p in directory.iterdir())
    groups = len(engine.optimizer.param_groups)
    engine.destroy()
    return {
        "losses": losses,
        "norms": norms,
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        "files": during,
        "groups": groups,
        "removed": not directory.exists(),
    }


def test_nvme_offload_through_initialize_matches_one_process(tmp_path: Path) -> None:
    root = tmp_path / "nvme"
    root.mkdir()
    per_rank = run_on_mesh(_train, WORLD, args=(str(root),), store_dir=tmp_path, timeout_s=120)
    ref = _models.reference("mlp", "fp32", STEPS)
    assert max(ref["norms"]) > _models.CLIP, "clipping must trigger for the test to bite"
    for result in per_rank:
        states = ("exp_avg", "exp_avg_sq", "master")
        assert result["files"] == [f"group{g}.{s}" for g in range(result["groups"]) for s in states]
        assert result["removed"]
    assert list(root.iterdir()) == []
    losses = torch.tensor([r["losses"] for r in per_rank], dtype=torch.float64).mean(0)
    expected = torch.tensor(ref["losses"], dtype=torch.float64)
    torch.testing.assert_close(losses, expected, rtol=1e-5, atol=0.0)
    norms = torch.tensor(per_rank[0]["norms"], dtype=torch.float64)
    torch.testing.assert_close(
        norms, torch.tensor(ref["norms"], dtype=torch.float64), rtol=1e-5, atol=0.0
    )
    for name, target in ref["params"].items():
        assert torch.equal(per_rank[0]["params"][name], per_rank[1]["params"][name])
        error = float((per_rank[0]["params"][name] - target).norm() / target.norm())
        assert error <= 1e-5, f"{name} off by {error:.3g} relative"
