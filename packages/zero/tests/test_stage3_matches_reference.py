"""ZeRO stage 3 trains like one process on the whole batch, and like stage 2, at 1 and 2 ranks.

The odd-sized MLP of `_training` with each ``Linear`` a unit (parameters straddle the rank
boundary inside every unit), AdamW with two param groups (the groups cut across units), an LR
scheduler and clipping; fp32 and bf16 (bf16 with the eager policy), gradient accumulation 1
and 4. One policy (eager) releases every unit after use (no reuse, no persistence) and
reduce-scatters in 200-element calls, so every forward and backward re-gathers; the other keeps
DeepSpeed's defaults. Tolerances are the stage 0-2 test's (`test_stage_matches_reference.py`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from deepshard.testing import import_beside, run_on_mesh

_training = import_beside(__file__, "_training.py")

BF16_U = 2.0**-8
EAGER = {"max_reuse_distance": 0, "param_persistence_threshold": 0, "reduce_bucket_size": 200}
CONFIGS = [(torch.float32, ga, eager) for ga in (1, 4) for eager in (True, False)] + [
    (torch.bfloat16, ga, True) for ga in (1, 4)
]


def train_stage3(
    group: Any, rank: int, world: int, *, ga: int, dtype: torch.dtype, policy: dict[str, Any]
) -> dict[str, Any]:
    """The `_training.train_zero` loop with the model sharded (stage 3)."""
    from deepshard.interface.config import ZeroConfig
    from deepshard.zero import ZeroOptimizer, ZeroPolicy, shard

    model = _training.make_model(dtype)
    inner = torch.optim.AdamW(_training.param_groups(list(model.parameters())), lr=_training.LR)
    sharded = shard(
        model, group=group, policy=ZeroPolicy(unit_classes=(torch.nn.Linear,), **policy)
    )
    zero = ZeroOptimizer(
        inner, sharded, config=ZeroConfig(stage=3), gradient_clipping=_training.CLIP
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(zero, _training.lr_factor)
    mb = _training.GLOBAL_BATCH // (world * ga)
    losses, norms = [], []
    for step in range(_training.STEPS):
        x, y = _training.batch(step)
        total = 0.0
        for m in range(ga):
            rows = slice((m * world + rank) * mb, (m * world + rank + 1) * mb)
            loss = _training.loss_fn(model, x[rows], y[rows]) / ga
            if m < ga - 1 and m % 2:  # the DDP way for some passes
                with zero.no_sync():
                    loss.backward()
            else:
                zero.backward(loss, is_boundary=m == ga - 1)
            total += loss.item()
        result = zero.step()
        scheduler.step()
        losses.append(total)
        norms.append(result.grad_norm)
    with sharded.gathered():
        params = [p.detach().float().clone() for p in model.parameters()]
    return {"losses": losses, "norms": norms, "params": params}


def _train_all(mesh: Any, configs: list[tuple[torch.dtype, int, bool]]) -> dict[Any, Any]:
    group, rank = mesh["dp"], mesh.get_rank()
    world = group.size()
    out: dict[Any, Any] = {
        config: train_stage3(
            group, rank, world, ga=config[1], dtype=config[0], policy=EAGER if config[2] else {}
        )
        for config in configs
    }
    for dtype, ga in ((torch.float32, 1), (torch.float32, 4), (torch.bfloat16, 4)):
        out[("stage2", dtype, ga)] = _training.train_zero(
            group, rank, world, stage=2, ga=ga, dtype=dtype
        )
    return out


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def _update_error(
    params: list[torch.Tensor], ref: list[torch.Tensor], init: list[torch.Tensor]
) -> float:
    off = sum(float(((p - r) ** 2).sum()) for p, r in zip(params, ref, strict=True)) ** 0.5
    moved = sum(float(((i - r) ** 2).sum()) for i, r in zip(init, ref, strict=True)) ** 0.5
    return off / moved


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2])
def test_stage3_matches_single_process_and_stage2(world: int, tmp_path: Path) -> None:
    per_rank = run_on_mesh(_train_all, world, args=(CONFIGS,), store_dir=tmp_path)
    refs = {dtype: _training.reference(dtype) for dtype in (torch.float32, torch.bfloat16)}
    assert max(refs[torch.float32]["norms"]) > _training.CLIP  # clipping is exercised
    for config in CONFIGS:
        dtype, ga, _ = config
        results = [r[config] for r in per_rank]
        for other in results[1:]:
            for a, b in zip(other["params"], results[0]["params"], strict=True):
                assert torch.equal(a, b), f"ranks disagree for {config}"
        losses = torch.tensor([sum(r["losses"][i] for r in results) / world for i in range(5)])
        ref = refs[dtype]
        tol = 1e-5 if dtype == torch.float32 else 2 * BF16_U
        assert _rel(losses, torch.tensor(ref["losses"])) < tol, config
        assert _rel(torch.tensor(results[0]["norms"]), torch.tensor(ref["norms"])) < tol, config
        if dtype == torch.float32:
            stage2 = per_rank[0][("stage2", dtype, ga)]["params"]
            for got, want, two in zip(results[0]["params"], ref["params"], stage2, strict=True):
                assert _rel(got, want) < 1e-5, config
                assert _rel(got, two) < 1e-6, config
        else:
            init = _training.initial_params(dtype)
            assert _update_error(results[0]["params"], ref["params"], init) < 0.1, config
            stage2 = per_rank[0][("stage2", dtype, 4)]["params"]
            if ga == 4:
                assert _update_error(results[0]["params"], stage2, init) < 0.1, config
