"""Frozen parameters stay out of ZeRO's buffers and untouched; parameters that get no gradient
count as zero gradients (so AdamW still decays them, as in DeepSpeed); zero-size parameters are
carried along. Checked at every stage on 2 ranks against a one-process reference that gives
unused parameters zero gradients. ``ignore_unused_parameters: false`` refuses the unused head.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from deepshard.testing import import_beside, run_on_mesh

_training = import_beside(__file__, "_training.py")
WORLD, STEPS = 2, 3


class MlpWithExtras(torch.nn.Module):
    """The test MLP with its first layer frozen, an unused head and an empty parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.mlp = _training.make_model()
        self.head = torch.nn.Linear(29, 3)  # never used in forward
        self.empty = torch.nn.Parameter(torch.zeros(0, 4))
        self.mlp[0].requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(x)


def _optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=_training.LR, weight_decay=0.5)


def _train(group: Any, stage: int, **config: Any) -> list[torch.Tensor]:
    from deepshard.interface.config import ZeroConfig
    from deepshard.zero import ZeroOptimizer

    rank = group.get_rank()
    model = MlpWithExtras()
    zero = ZeroOptimizer(_optimizer(model), group=group, config=ZeroConfig(stage=stage, **config))
    mb = _training.GLOBAL_BATCH // WORLD
    for step in range(STEPS):
        x, y = _training.batch(step)
        rows = slice(rank * mb, (rank + 1) * mb)
        zero.backward(_training.loss_fn(model, x[rows], y[rows]))
        zero.step()
    return [p.detach().clone() for p in model.parameters()]


def _all(mesh: Any) -> dict[str, Any]:
    from deepshard.interface.errors import ConfigError

    group = mesh["dp"]
    out: dict[str, Any] = {f"stage{s}": _train(group, s) for s in (0, 1, 2)}
    try:
        _train(group, 2, ignore_unused_parameters=False)
    except ConfigError as exc:
        out["strict"] = str(exc)
    return out


def _reference() -> list[torch.Tensor]:
    model = MlpWithExtras()
    inner = _optimizer(model)
    for step in range(STEPS):
        x, y = _training.batch(step)
        inner.zero_grad()
        _training.loss_fn(model, x, y).backward()
        torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.grad is not None], 1.0)
        for p in model.parameters():
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)  # ZeRO's treatment of an unused parameter
        inner.step()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.slow
def test_frozen_unused_and_empty_parameters(tmp_path: Path) -> None:
    per_rank = run_on_mesh(_all, WORLD, store_dir=tmp_path)
    ref = _reference()
    initial = [p.detach().clone() for p in MlpWithExtras().parameters()]
    names = [n for n, _ in MlpWithExtras().named_parameters()]
    for out in per_rank:
        assert "zero_optimization.ignore_unused_parameters" in out["strict"]
        for stage in (0, 1, 2):
            params = out[f"stage{stage}"]
            for name, got, want, init in zip(names, params, ref, initial, strict=True):
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7, msg=name)
                if name.startswith("mlp.0."):
                    assert torch.equal(got, init), "a frozen parameter changed"
                elif name.startswith("head."):
                    assert not torch.equal(got, init), "the unused head was not decayed"
