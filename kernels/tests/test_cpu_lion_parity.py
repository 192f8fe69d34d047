"""cpu_lion_step on every compiled SIMD path against its twin and the Lion formula.

1. ``reference_lion_step`` (the twin) must be matched bit for bit, for every dtype combination
   and for sizes that exercise the vector body and the scalar tail.
2. The formula of the paper (Chen et al. 2023, "Symbolic Discovery of Optimization
   Algorithms"), written here in float64::

       c = beta1 m + (1 - beta1) g;  p = p (1 - lr wd) - lr sign(c);  m = beta2 m + (1 - beta2) g

   Each step starts both sides from the kernel's current state, so differences cannot compound.
   The kernel works in float32 with float32 constants (``1 - 0.99f`` is 1e-6 away from 0.01
   relatively), so per step: ``m`` within 2e-6 of the size of its terms; ``p`` within 3e-7 |p| +
   1e-6 lr -- except where ``c`` is so close to 0 that float32 cannot tell its sign (|c| below
   1e-5 of its terms), where the step may go the other way (a 2 lr difference). Such elements
   must be rare.
"""

from __future__ import annotations

import itertools

import pytest
import torch

import deepshard.kernels as kernels

LR, BETA1, BETA2 = 1e-4, 0.9, 0.99
STEPS = 10


def _run(step_fn, numel, grad_dtype, state_dtype, out_dtype, weight_decay):
    gen = torch.Generator().manual_seed(3)
    param = torch.randn(numel, generator=gen)
    exp_avg = torch.zeros(numel, dtype=state_dtype)
    out = None if out_dtype is None else torch.empty(numel, dtype=out_dtype)
    for _ in range(STEPS):
        grad = torch.randn(numel, generator=gen).to(grad_dtype)
        step_fn(
            param, grad, exp_avg, lr=LR, beta1=BETA1, beta2=BETA2, weight_decay=weight_decay,
            param_out=out,
        )  # fmt: skip
    return param, exp_avg, out


@pytest.mark.parametrize("numel", [7, 64, 1031])
def test_every_path_equals_the_twin_bit_for_bit(simd_path, numel):
    combos = itertools.product(
        (torch.float32, torch.bfloat16, torch.float16),
        (torch.float32, torch.bfloat16),
        (None, torch.bfloat16, torch.float16),
    )
    for grad_dtype, state_dtype, out_dtype in combos:
        with kernels.use_simd_path(simd_path):
            got = _run(kernels.cpu_lion_step, numel, grad_dtype, state_dtype, out_dtype, 0.1)
        want = _run(kernels.reference_lion_step, numel, grad_dtype, state_dtype, out_dtype, 0.1)
        case = f"{simd_path} {grad_dtype} state={state_dtype} out={out_dtype}"
        assert torch.equal(got[0], want[0]), f"param differs: {case}"
        assert torch.equal(got[1], want[1]), f"exp_avg differs: {case}"
        if out_dtype is not None:
            assert torch.equal(got[2], want[2]), f"param_out differs: {case}"
            assert torch.equal(got[2], got[0].to(out_dtype)), f"param_out != param: {case}"


def _formula(param, grad, exp_avg, weight_decay):
    p, g, m = param.double(), grad.double(), exp_avg.double()
    c = BETA1 * m + (1 - BETA1) * g
    new_p = p * (1 - LR * weight_decay) - LR * torch.sign(c)
    new_m = BETA2 * m + (1 - BETA2) * g
    undecided = c.abs() <= 1e-5 * (BETA1 * m.abs() + (1 - BETA1) * g.abs())
    return new_p, new_m, undecided, BETA2 * m.abs() + (1 - BETA2) * g.abs()


@pytest.mark.parametrize("numel", [7, 64, 1_000_003])
def test_every_path_follows_the_lion_formula(simd_path, numel):
    gen = torch.Generator().manual_seed(5)
    steps = STEPS if numel < 1000 else 3  # per-step checks need no long run; keeps 1M quick
    for grad_dtype in (torch.float32, torch.bfloat16, torch.float16):
        weight_decay = 0.1 if grad_dtype != torch.bfloat16 else 0.0
        param, exp_avg = torch.randn(numel, generator=gen), torch.randn(numel, generator=gen)
        for step in range(steps):
            grad = torch.randn(numel, generator=gen).to(grad_dtype)
            want_p, want_m, undecided, m_terms = _formula(param, grad, exp_avg, weight_decay)
            with kernels.use_simd_path(simd_path):
                kernels.cpu_lion_step(
                    param, grad, exp_avg, lr=LR, beta1=BETA1, beta2=BETA2,
                    weight_decay=weight_decay,
                )  # fmt: skip
            case = f"{simd_path} {grad_dtype} step {step}"
            assert bool(((exp_avg.double() - want_m).abs() <= 2e-6 * m_terms).all()), case
            gap = (param.double() - want_p).abs()
            tol = 3e-7 * want_p.abs() + 1e-6 * LR
            assert bool((gap[~undecided] <= tol[~undecided]).all()), case
            assert bool((gap[undecided] <= 2 * LR + tol[undecided]).all()), case
            assert undecided.double().mean().item() < 1e-4, case
