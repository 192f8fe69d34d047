"""cpu_adam_step with bfloat16 moments against torch's step on moments rounded each step.

The reference is derived from torch.optim.AdamW itself. At every step both sides start from the
same state -- the kernel's current float32 parameter and bfloat16 moments -- torch's state being
the moments widened to float32; after torch's step its new float32 moments are rounded to
bfloat16 (nearest even, torch's ``.to``). That is what the kernel does in one pass: it reads the
bf16 moments, computes in float32, updates the parameter with the unrounded moments and stores
the moments rounded. Comparing one step at a time from a common state keeps differences from
compounding, so the bounds below hold per step:

- parameter: float32 noise only (the update uses unrounded moments on both sides): torch's
  ``lerp``/float64 constants/1-ulp ``sqrt`` against the kernel's float32 operations give at most
  about 1 ulp of the parameter plus ~1e-6 lr where the first moment cancels:
  ``rtol=3e-7, atol=2e-6 * lr``;
- moments: those few float32 ulps change the bf16 rounding only where the float32 value lies
  within them of a bf16 rounding boundary, a chance of ~ few * 2^-23 / 2^-8 per element (well
  under 0.1%) -- more with bf16 gradients, whose short products land exactly on bf16 midpoints
  far more often (observed ~0.2%), so the test allows 1%; there the two differ by one bf16 ulp,
  plus the float32 noise itself where the moment cancels to almost nothing (a few float32 ulps
  of its terms, ``b1 |m| + (1 - b1) |g|``).
  Everywhere else they are equal.
"""

from __future__ import annotations

import pytest
import torch

import deepshard.kernels as kernels

LR = 0.0010000000474974513  # float32(1e-3)
BETA1 = 0.8999999761581421  # float32(0.9)
BETA2 = 0.9990000128746033  # float32(0.999)
EPS = 9.99999993922529e-09  # float32(1e-8)
WD = 0.009999999776482582  # float32(0.01)
STEPS = 10
NUMEL = 100_003  # bf16 semantics need no more; the fp32 tests cover 1_000_003


def _torch_step(param, grad, exp_avg, exp_avg_sq, step):
    """torch.optim.AdamW's step ``step`` from bf16 moments; returns the new (param, m, v)."""
    param = param.clone()
    opt = torch.optim.AdamW([param], lr=LR, betas=(BETA1, BETA2), eps=EPS, weight_decay=WD)
    opt.state[param] = {
        "step": torch.tensor(float(step - 1)),
        "exp_avg": exp_avg.float(),
        "exp_avg_sq": exp_avg_sq.float(),
    }
    param.grad = grad.float()
    opt.step()
    state = opt.state[param]
    return param, state["exp_avg"].to(torch.bfloat16), state["exp_avg_sq"].to(torch.bfloat16)


def _bf16_ulp(x: torch.Tensor) -> torch.Tensor:
    """Spacing of bf16 numbers at |x|: 2^(e - 8) for |x| in [2^(e-1), 2^e) (8 significant bits)."""
    _, exponent = torch.frexp(x.float())
    return torch.ldexp(torch.ones_like(x, dtype=torch.float32), exponent - 8)


def _assert_moment_close(
    got: torch.Tensor, want: torch.Tensor, terms: torch.Tensor, what: str
) -> None:
    differ = got != want
    assert differ.float().mean().item() < 1e-2, f"{what}: too many bf16 roundings differ"
    gap = (got.float() - want.float()).abs()[differ]
    one_ulp = torch.maximum(_bf16_ulp(got[differ]), _bf16_ulp(want[differ]))
    noise = 4 * 2.0**-24 * terms[differ]
    assert bool((gap <= one_ulp + noise).all()), f"{what}: differs by more than one bf16 ulp"


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
def test_bf16_moments_match_torch_rounding_each_step(simd_path, grad_dtype):
    gen = torch.Generator().manual_seed(7)
    param = torch.randn(NUMEL, generator=gen)
    exp_avg = torch.zeros(NUMEL, dtype=torch.bfloat16)
    exp_avg_sq = torch.zeros(NUMEL, dtype=torch.bfloat16)
    for step in range(1, STEPS + 1):
        grad = torch.randn(NUMEL, generator=gen).to(grad_dtype)
        want = _torch_step(param, grad, exp_avg, exp_avg_sq, step)
        g = grad.float().abs()
        m_terms = BETA1 * exp_avg.float().abs() + (1 - BETA1) * g
        v_terms = BETA2 * exp_avg_sq.float() + (1 - BETA2) * g * g
        with kernels.use_simd_path(simd_path):
            kernels.cpu_adam_step(
                param, grad, exp_avg, exp_avg_sq, step=step, lr=LR, beta1=BETA1, beta2=BETA2,
                eps=EPS, weight_decay=WD,
            )  # fmt: skip
        torch.testing.assert_close(param, want[0], rtol=3e-7, atol=2e-6 * LR, msg=f"step {step}")
        _assert_moment_close(exp_avg, want[1], m_terms, f"exp_avg, step {step}")
        _assert_moment_close(exp_avg_sq, want[2], v_terms, f"exp_avg_sq, step {step}")
