"""Norm, overflow check and the unscale-and-clip factor against torch's own clip_grad_norm_.

Single-process (``group=None``: the tensors are the whole vector); the distributed norm over
partitions is checked in ``test_comm_bytes_per_step.py`` and by every training test.
"""

from __future__ import annotations

import math

import pytest
import torch

from deepshard.interface.errors import ConfigError
from deepshard.zero import global_grad_norm, grad_overflow, scale_factor


def _grads(dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    shapes = [(37, 13), (37,), (0,), (29, 37), (7,)]
    return [torch.randn(s, generator=gen).to(dtype) for s in shapes]


@pytest.mark.parametrize("norm_type", [2.0, 1.0, 3.0, math.inf])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_matches_torch(norm_type: float, dtype: torch.dtype) -> None:
    grads = _grads(dtype)
    params = [torch.nn.Parameter(g.float()) for g in grads]
    for p, g in zip(params, grads, strict=True):
        p.grad = g.float()
    nonempty = [p.grad for p in params if p.numel()]  # torch refuses empty ones for inf
    want = torch.nn.utils.get_total_norm(nonempty, norm_type).item()
    got = global_grad_norm(grads, norm_type=norm_type, group=None)
    assert not got.overflow
    assert got.norm == pytest.approx(want, rel=1e-6)


@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
@pytest.mark.parametrize("norm_type", [2.0, math.inf])
def test_non_finite_gradients_are_an_overflow(bad: float, norm_type: float) -> None:
    grads = _grads()
    grads[3][5, 7] = bad
    assert global_grad_norm(grads, norm_type=norm_type, group=None).overflow
    assert grad_overflow(grads, group=None)
    assert not grad_overflow(_grads(), group=None)
    assert not global_grad_norm([], group=None).overflow
    assert global_grad_norm([], group=None).norm == 0.0


@pytest.mark.parametrize("max_norm", [0.5, 1.0, 100.0])
def test_clip_factor_matches_clip_grad_norm(max_norm: float) -> None:
    grads = _grads()
    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    for p, g in zip(params, grads, strict=True):
        p.grad = g.clone()
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm).item()
    factor = scale_factor(norm, clip=max_norm, loss_scale=1.0)
    for p, g in zip(params, grads, strict=True):
        torch.testing.assert_close(g * factor, p.grad, rtol=1e-6, atol=0)
    if norm <= max_norm:
        assert factor == 1.0


def test_unscaling_combines_with_clipping() -> None:
    scale = 1024.0
    assert scale_factor(None, clip=0.0, loss_scale=scale) == 1 / scale
    assert scale_factor(None, clip=0.0, loss_scale=1.0) == 1.0
    # norm 4 (unscaled), clip 2: the scaled gradients shrink by scale and by 2 / (4 + 1e-6)
    assert scale_factor(4.0, clip=2.0, loss_scale=scale) == pytest.approx(2 / (4 + 1e-6) / scale)
    with pytest.raises(ConfigError, match=r"zero_optimization\.compute_grad_norm"):
        scale_factor(None, clip=1.0, loss_scale=1.0)
    with pytest.raises(ConfigError, match="norm_type"):
        global_grad_norm(_grads(), norm_type=0.0, group=None)
