"""A non-finite gradient on one rank skips the step on every rank at every stage, leaving the
parameters, the masters and the inner optimizer's state untouched; training then continues.
Loss scaling is undone exactly: training with ``loss × S`` and ``step(loss_scale=S)`` equals
training without scaling. The ``compute_grad_norm: false`` fast path still detects overflow.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from deepshard.testing import import_beside, run_on_mesh

_training = import_beside(__file__, "_training.py")

SCALE = 1024.0


def _snapshot(model: torch.nn.Module, zero: Any) -> dict[str, list[torch.Tensor]]:
    state = [
        value.clone()
        for per_param in zero.state.values()
        for value in per_param.values()
        if isinstance(value, torch.Tensor)
    ]
    return {
        "params": [p.detach().clone() for p in model.parameters()],
        "masters": [m.detach().clone() for m in zero.master_partitions],
        "state": state,
    }


def _same(a: dict[str, list[torch.Tensor]], b: dict[str, list[torch.Tensor]]) -> bool:
    return all(
        len(a[k]) == len(b[k]) and all(torch.equal(x, y) for x, y in zip(a[k], b[k], strict=True))
        for k in a
    )


def _run(group: Any, stage: int, *, poison: int | None, scale: float, **config: Any) -> Any:
    """Four steps; at step ``poison`` rank 1's loss is multiplied by inf."""
    from deepshard.interface.config import ZeroConfig
    from deepshard.zero import ZeroOptimizer

    rank, world = group.get_rank(), group.size()
    clip = 0.0 if config.get("compute_grad_norm") is False else _training.CLIP
    model = _training.make_model()
    inner = torch.optim.AdamW(_training.param_groups(list(model.parameters())), lr=_training.LR)
    zero = ZeroOptimizer(
        inner, group=group, config=ZeroConfig(stage=stage, **config), gradient_clipping=clip
    )
    mb = _training.GLOBAL_BATCH // world
    results, skipped_ok = [], True
    for step in range(4):
        x, y = _training.batch(step)
        loss = _training.loss_fn(
            model, x[rank * mb : (rank + 1) * mb], y[rank * mb : (rank + 1) * mb]
        )
        if step == poison and rank == 1:
            loss = loss * torch.inf
        before = _snapshot(model, zero)
        zero.backward(loss * scale)
        result = zero.step(loss_scale=scale)
        results.append((result.overflow, result.grad_norm))
        if step == poison:
            skipped_ok = _same(before, _snapshot(model, zero))
    params = [p.detach().clone() for p in model.parameters()]
    return {"results": results, "skipped_ok": skipped_ok, "params": params}


def _all_stages(mesh: Any) -> dict[str, Any]:
    group = mesh["dp"]
    out: dict[str, Any] = {}
    for stage in (0, 1, 2):
        out[f"poison{stage}"] = _run(group, stage, poison=2, scale=1.0, overlap_comm=True)
        out[f"plain{stage}"] = _run(group, stage, poison=None, scale=1.0)
        out[f"scaled{stage}"] = _run(group, stage, poison=None, scale=SCALE)
    for stage in (1, 2):
        out[f"nonorm{stage}"] = _run(group, stage, poison=1, scale=1.0, compute_grad_norm=False)
    return out


@pytest.mark.slow
def test_overflow_skips_the_step_and_loss_scale_is_undone(tmp_path: Path) -> None:
    per_rank = run_on_mesh(_all_stages, 2, store_dir=tmp_path)
    for out in per_rank:
        for stage in (0, 1, 2):
            poisoned = out[f"poison{stage}"]
            flags = [overflow for overflow, _ in poisoned["results"]]
            assert flags == [False, False, True, False], f"stage {stage}: {flags}"
            assert poisoned["skipped_ok"], f"stage {stage} changed state on an overflow step"
            norm = poisoned["results"][2][1]
            assert norm is not None and not torch.isfinite(torch.tensor(norm))
            plain, scaled = out[f"plain{stage}"], out[f"scaled{stage}"]
            # a power-of-two scale is exact in fp32: unscaling must give the same training
            for a, b in zip(scaled["params"], plain["params"], strict=True):
                torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
            for (_, n_scaled), (_, n_plain) in zip(
                scaled["results"], plain["results"], strict=True
            ):
                assert n_scaled == pytest.approx(n_plain, rel=1e-6)
        for stage in (1, 2):
            fast = out[f"nonorm{stage}"]
            assert [f for f, _ in fast["results"]] == [False, True, False, False]
            assert all(n is None for _, n in fast["results"])
            assert fast["skipped_ok"]
    # the skipped step left every rank with the same model
    for key in per_rank[0]:
        for a, b in zip(per_rank[0][key]["params"], per_rank[1][key]["params"], strict=True):
            assert torch.equal(a, b)
