"""Lion follows its formula, written out here, for the CPU kernel and foreach paths.

    c = beta1*m + (1-beta1)*g;  p = p*(1 - lr*wd) - lr*sign(c);  m = beta2*m + (1-beta2)*g

The update is a sign, so an element whose ``c`` lies within rounding of zero may flip with the
order of the floating-point operations; such elements (|c| below 1e-7 at some step, a handful
in a million) are left out of the comparison and counted instead.
"""

from __future__ import annotations

import functools

import pytest
import torch

from deepshard.optimizers import Lion

STEPS = 10
LR = 1e-3
BETAS = (0.9, 0.99)


def _reference(start: torch.Tensor, grads: list[torch.Tensor], wd: float):
    p = start.clone()
    m = torch.zeros_like(p)
    near_zero = torch.zeros_like(p, dtype=torch.bool)
    for grad in grads:
        g = grad.float()
        c = BETAS[0] * m + (1 - BETAS[0]) * g
        near_zero |= c.abs() < 1e-7
        p = p * (1 - LR * wd) - LR * torch.sign(c)
        m = BETAS[1] * m + (1 - BETAS[1]) * g
    return p, m, near_zero


CASES = [
    (impl, size, dtype, wd)
    for impl in ("cpu", "foreach")
    for size in (7, 64)
    for dtype in (torch.float32, torch.bfloat16, torch.float16)
    for wd in (0.0, 0.1)
]
CASES += [(impl, 1_000_003, torch.bfloat16, 0.1) for impl in ("cpu", "foreach")]


@functools.cache
def _inputs(size: int, grad_dtype: torch.dtype) -> tuple[torch.Tensor, list[torch.Tensor]]:
    generator = torch.Generator().manual_seed(size)
    start = torch.randn(size, generator=generator)
    return start, [torch.randn(size, generator=generator).to(grad_dtype) for _ in range(STEPS)]


@functools.cache
def _expected(size: int, grad_dtype: torch.dtype, wd: float):
    start, grads = _inputs(size, grad_dtype)
    return _reference(start, grads, wd)


@pytest.mark.parametrize(("impl", "size", "grad_dtype", "wd"), CASES)
def test_lion_matches_formula(impl: str, size: int, grad_dtype: torch.dtype, wd: float) -> None:
    start, grads = _inputs(size, grad_dtype)
    param = torch.nn.Parameter(start.clone())
    param.grad_dtype = None
    optimizer = Lion([param], lr=LR, betas=BETAS, weight_decay=wd, impl=impl)
    for grad in grads:
        param.grad = grad.clone()
        optimizer.step()
    expected, momentum, near_zero = _expected(size, grad_dtype, wd)
    keep = ~near_zero
    assert near_zero.sum() <= max(1, size // 10_000)
    torch.testing.assert_close(param.detach()[keep], expected[keep], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(optimizer.state[param]["exp_avg"], momentum, rtol=1e-5, atol=1e-6)
    assert not torch.equal(param.detach(), start)


def test_lion_group_lr_and_weight_decay_are_per_group() -> None:
    a = torch.nn.Parameter(torch.ones(4))
    b = torch.nn.Parameter(torch.ones(4))
    optimizer = Lion([{"params": [a]}, {"params": [b], "lr": 0.5, "weight_decay": 1.0}], lr=0.1)
    a.grad = torch.ones(4)
    b.grad = -torch.ones(4)
    optimizer.step()
    torch.testing.assert_close(a.detach(), torch.full((4,), 1 - 0.1))
    torch.testing.assert_close(b.detach(), torch.full((4,), 1 * (1 - 0.5 * 1.0) + 0.5))
