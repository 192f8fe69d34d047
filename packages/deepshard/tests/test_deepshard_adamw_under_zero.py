"""``{"optimizer": {"type": "AdamW"}}`` (DeepShard's own AdamW, no ``torch_adam``) runs under ZeRO.

DeepShard's Adam, AdamW, CPUAdam and Lion declare themselves element-wise (``zero_safe``), so
``initialize`` wraps them with ZeRO without ``zero_allow_untested_optimizer``. One
``run_on_mesh`` call on 2 ranks trains the odd-sized MLP at stage 2 for `STEPS` steps with 2
accumulation steps and clipping (which triggers), and the result is compared with the
single-process reference: ``torch.optim.AdamW`` and ``clip_grad_norm_`` on the whole batch
(`_models.reference`). DeepShard's AdamW computes the same formula in another order (its CPU
kernel takes ``sqrt`` in fp64), so the bounds are those of the fp32 equivalence test: losses and
gradient norms within 1e-5 relative, every parameter tensor within 1e-5 of the reference in
relative norm.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from deepshard.testing import import_beside, run_on_mesh

pytestmark = pytest.mark.slow  # the main run covers it; the package env keeps a few lighter ones

_models = import_beside(__file__, "_models.py")
STEPS = 6
GA = 2
WORLD = 2


def _train(mesh: Any) -> dict[str, Any]:
    import deepshard.engine as ds
    from deepshard.optimizers import AdamW

    rank, world = mesh.get_rank(), mesh.size()
    model = _models.make_mlp()
    config = _models.engine_config(stage=2, precision="fp32", ga=GA)
    config["optimizer"] = {
        "type": "AdamW",
        "params": {"lr": _models.LR, "weight_decay": _models.WEIGHT_DECAY},
    }
    engine, _, _, _ = ds.initialize(model, config, mesh=mesh)
    inner = type(engine.optimizer.inner)
    losses, norms = [], []
    for step in range(STEPS):
        batch = _models.mlp_batch(step)
        total = 0.0
        for micro in range(GA):
            rows = _models.micro_batch(batch, micro=micro, rank=rank, world=world, ga=GA)
            total += engine.backward(_models.mlp_loss(engine, rows, torch.float32)).item()
            engine.step()
        assert engine.was_step_applied()
        losses.append(total)
        norms.append(engine.get_global_grad_norm())
    return {
        "inner_is_deepshard_adamw": inner is AdamW,
        "losses": losses,
        "norms": norms,
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
    }


def test_deepshard_adamw_at_stage_2_matches_torch_adamw(tmp_path: Path) -> None:
    per_rank = run_on_mesh(_train, WORLD, store_dir=tmp_path, timeout_s=120)
    ref = _models.reference("mlp", "fp32", STEPS)
    assert max(ref["norms"]) > _models.CLIP, "clipping must trigger for the test to bite"
    assert all(r["inner_is_deepshard_adamw"] for r in per_rank)
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
