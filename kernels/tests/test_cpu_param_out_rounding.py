"""Conversions on every SIMD path: the param_out copy rounds and 16-bit grads widen like torch.

With ``lr = 0`` a step leaves every parameter as it is (the update is ``0 * m / denom`` with
``denom >= eps > 0``), so ``param_out`` is the conversion of hand-picked float32 values: ties
between two bf16/fp16 numbers (both parities), fp16 subnormals and the fp16 underflow threshold,
the largest finite values and the overflow threshold, infinities, signed zeros, and NaN.
"""

from __future__ import annotations

import pytest
import torch

import deepshard.kernels as kernels


def _special_values() -> torch.Tensor:
    bits = [
        0x3F808000, 0x3F818000, 0x3F808001, 0x3F817FFF,  # bf16 ties to even / just off a tie
        0x3F801000, 0x3F803000, 0x3F801001,  # fp16 ties (1 + 2^-11, 1 + 3 * 2^-11)
        0x33800000, 0x33000000, 0x33000001, 0x33C00000,  # fp16 subnormal range and underflow
        0x38800000, 0x387FC000, 0x387FE000,  # smallest fp16 normal, its neighbourhood
        0x477FE000, 0x477FEFFF, 0x477FF000, 0x7F7FFFFF,  # fp16 max, overflow threshold, f32 max
        0x00000001, 0x80000001, 0x00800000,  # float32 subnormal, smallest normal
        0x7F800000, 0xFF800000, 0x00000000, 0x80000000,  # infinities, signed zeros
        0x7FC00000, 0xFFC00001, 0x7F800001,  # NaNs (quiet, negative, signalling)
    ]  # fmt: skip
    special = torch.tensor(bits, dtype=torch.int64).to(torch.int32).view(torch.float32)
    negated = -special
    filler = torch.randn(97, generator=torch.Generator().manual_seed(1))  # vector body + tail
    return torch.cat([special, negated, filler])


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16])
def test_param_out_equals_torch_conversion(simd_path, out_dtype):
    param = _special_values()
    numel = param.numel()
    out = torch.empty(numel, dtype=out_dtype)
    with kernels.use_simd_path(simd_path):
        kernels.cpu_adam_step(
            param, torch.zeros(numel), torch.zeros(numel), torch.zeros(numel), step=1, lr=0.0,
            beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, param_out=out,
        )  # fmt: skip
    want = param.to(out_dtype)
    nan = param.isnan()
    assert torch.equal(out.isnan(), nan), "NaN must stay NaN, and only NaN"
    assert torch.equal(out[~nan], want[~nan])
    # Signed zeros and infinities keep their sign bit.
    assert torch.equal(out[~nan].float().signbit(), want[~nan].float().signbit())


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16])
def test_param_out_rounds_random_bit_patterns_like_torch(simd_path, out_dtype):
    # Any float32 at all, NaNs and infinities included, 2^18 of them.
    gen = torch.Generator().manual_seed(2)
    bits = torch.randint(-(2**31), 2**31, (1 << 18,), generator=gen, dtype=torch.int64)
    param = bits.to(torch.int32).view(torch.float32)
    numel = param.numel()
    out = torch.empty(numel, dtype=out_dtype)
    with kernels.use_simd_path(simd_path):
        kernels.cpu_lion_step(
            param, torch.zeros(numel), torch.zeros(numel), lr=0.0, beta1=0.9, beta2=0.99,
            weight_decay=0.0, param_out=out,
        )  # fmt: skip
    nan = param.isnan()
    assert torch.equal(out.isnan(), nan)
    assert torch.equal(out[~nan], param[~nan].to(out_dtype))


@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float16])
def test_every_16_bit_gradient_widens_exactly(simd_path, grad_dtype):
    # With beta1 = 0 the first moment becomes the gradient itself, 0 * 0 + 1 * g, so exp_avg
    # shows the kernel's widening of all 65536 bit patterns, subnormals and NaNs included.
    grad = torch.arange(-(2**15), 2**15, dtype=torch.int64).to(torch.int16).view(grad_dtype)
    numel = grad.numel()
    exp_avg = torch.zeros(numel)
    with kernels.use_simd_path(simd_path):
        kernels.cpu_adam_step(
            torch.zeros(numel), grad, exp_avg, torch.zeros(numel), step=1, lr=0.0, beta1=0.0,
            beta2=0.5, eps=1.0, weight_decay=0.0,
        )  # fmt: skip
    want = grad.float()
    nan = want.isnan()
    assert torch.equal(exp_avg.isnan(), nan)
    assert torch.equal(exp_avg[~nan], want[~nan])  # (-0 arrives as +0: 0 * 0 + -0 is +0)
