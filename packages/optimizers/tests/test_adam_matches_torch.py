"""Adam/AdamW agree with torch.optim.Adam/AdamW for every implementation.

Each case runs 10 steps from the same start with the same gradients. A bf16/fp16 gradient is
fed to our fp32 parameter as is (``grad_dtype=None`` lets torch store it) and to the torch
reference as its exact fp32 value. torch has no switch for bias correction, so without it the
reference is the update written out below in fp64.
"""

from __future__ import annotations

import functools
import itertools

import pytest
import torch

from deepshard.optimizers import Adam, AdamW, CPUAdam

STEPS = 10
LR = 1e-2
BETAS = (0.9, 0.999)
EPS = 1e-8
GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _gradients(size: int, dtype: torch.dtype, seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(size, generator=generator).to(dtype) for _ in range(STEPS)]


def _ours(impl: str, start: torch.Tensor, adam_w_mode: bool, **kwargs: object) -> Adam:
    param = torch.nn.Parameter(start.clone())
    param.grad_dtype = None  # accept gradients of another dtype
    if impl == "cpu":
        return CPUAdam([param], adamw_mode=adam_w_mode, **kwargs)  # type: ignore[arg-type]
    if adam_w_mode:
        return AdamW([param], impl=impl, **kwargs)  # type: ignore[arg-type]
    return Adam([param], impl=impl, adam_w_mode=False, **kwargs)  # type: ignore[arg-type]


def _run_ours(optimizer: torch.optim.Optimizer, grads: list[torch.Tensor]) -> torch.Tensor:
    (param,) = optimizer.param_groups[0]["params"]
    for grad in grads:
        param.grad = grad.clone()
        optimizer.step()
    return param.detach()


def _run_torch(start: torch.Tensor, grads: list[torch.Tensor], adam_w_mode: bool, wd: float):
    param = torch.nn.Parameter(start.clone())
    cls = torch.optim.AdamW if adam_w_mode else torch.optim.Adam
    optimizer = cls([param], lr=LR, betas=BETAS, eps=EPS, weight_decay=wd, foreach=False)
    for grad in grads:
        param.grad = grad.float()
        optimizer.step()
    return param.detach()


def _run_uncorrected(start: torch.Tensor, grads: list[torch.Tensor], adam_w_mode: bool, wd: float):
    """Adam without bias correction, written out: p -= lr * m / (sqrt(v) + eps)."""
    p = start.double()
    m = torch.zeros_like(p)
    v = torch.zeros_like(p)
    for grad in grads:
        g = grad.double()
        if not adam_w_mode:
            g = g + wd * p
        m = BETAS[0] * m + (1 - BETAS[0]) * g
        v = BETAS[1] * v + (1 - BETAS[1]) * g * g
        if adam_w_mode:
            p = p * (1 - LR * wd)
        p = p - LR * m / (v.sqrt() + EPS)
    return p.float()


@functools.cache
def _inputs(size: int, grad_dtype: torch.dtype) -> tuple[torch.Tensor, list[torch.Tensor]]:
    start = torch.randn(size, generator=torch.Generator().manual_seed(size))
    return start, _gradients(size, grad_dtype, seed=size + 1)


@functools.cache
def _expected(size: int, grad_dtype: torch.dtype, wd: float, bias: bool, w_mode: bool):
    """The reference result, computed once and shared by the three implementations."""
    start, grads = _inputs(size, grad_dtype)
    if bias:
        return _run_torch(start, grads, w_mode, wd)
    return _run_uncorrected(start, grads, w_mode, wd)


def _check(impl: str, size: int, grad_dtype: torch.dtype, wd: float, bias: bool, w_mode: bool):
    start, grads = _inputs(size, grad_dtype)
    optimizer = _ours(impl, start, w_mode, lr=LR, betas=BETAS, eps=EPS, weight_decay=wd,
                      bias_correction=bias)  # fmt: skip
    ours = _run_ours(optimizer, grads)
    expected = _expected(size, grad_dtype, wd, bias, w_mode)
    # Without bias correction the reference is fp64: each fp32 step (up to 3*lr here) carries a
    # relative rounding error of ~1e-5, so 10 steps may drift ~5e-6; a wrong formula is off by
    # ~1e-2. Against torch (same fp32 arithmetic) the bound is tighter.
    torch.testing.assert_close(ours, expected, rtol=1e-5, atol=2e-6 if bias else 1e-5)
    assert not torch.equal(ours, start)
    state = optimizer.state[optimizer.param_groups[0]["params"][0]]
    assert state["step"] == STEPS
    assert state["exp_avg"].dtype == torch.float32


SMALL = list(itertools.product(("foreach", "fused", "cpu"), (7, 64), GRAD_DTYPES, (0.0, 0.1),
                               (True, False), (True, False)))  # fmt: skip


@pytest.mark.parametrize(("impl", "size", "grad_dtype", "wd", "bias", "w_mode"), SMALL)
def test_small_tensors_match(impl, size, grad_dtype, wd, bias, w_mode) -> None:
    _check(impl, size, grad_dtype, wd, bias, w_mode)


IMPLS = ("foreach", "fused", "cpu")
LARGE = [  # (grad dtype, bias correction, adam_w_mode); every grad dtype and mode is covered
    (torch.bfloat16, True, True),
    (torch.float16, False, True),
    (torch.float32, True, False),
]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize(("grad_dtype", "bias", "w_mode"), LARGE)
def test_million_elements_match(impl: str, grad_dtype: torch.dtype, bias: bool, w_mode: bool):
    _check(impl, 1_000_003, grad_dtype, wd=0.1, bias=bias, w_mode=w_mode)
