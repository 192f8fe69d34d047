"""bf16/fp16 parameters updated in place, on every compiled SIMD path.

A 16-bit parameter is widened to float32 on load, stepped with the float32 operations of the
float32 path and rounded to nearest even on store; its moments are float32 or, as
DeepSpeedCPUAdam's ``fp32_optimizer_states=False``, of the parameter's dtype. Checked here:

1. Every path equals the pure-torch twin bit for bit (the twin widens with ``.float()`` and
   rounds with torch's ``copy_``), for Adam/AdamW/Lion, every gradient dtype, both moment
   dtypes, sizes with and without a scalar tail, and thread splits.
2. Loads and stores on their own, against torch's conversions and independent of the twin:
   every one of the 65536 bit patterns of the parameter dtype survives a step that leaves it
   unchanged; a Lion step ``p - lr*sign(g)`` (exact in float32 for these lr, see below) rounds
   like ``.to(dtype)`` at ties, in the subnormal range and at the overflow threshold; and 16-bit
   moments store random float32 bit patterns (NaN, infinities, subnormals) like ``.to(dtype)``.

NaN payloads are not compared (the paths keep the top payload bits, torch canonicalises bf16
NaN); NaN-ness is.
"""

from __future__ import annotations

import itertools

import pytest
import torch

import deepshard.kernels as kernels

ADAM = {"lr": 1e-2, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.01}
LION = {"lr": 1e-3, "beta1": 0.9, "beta2": 0.99, "weight_decay": 0.1}
STEPS = 10
SIXTEEN = (torch.bfloat16, torch.float16)
INT16 = torch.int16


def _all_patterns(dtype: torch.dtype) -> torch.Tensor:
    return torch.arange(-(2**15), 2**15, dtype=torch.int64).to(INT16).view(dtype)


def _same(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Bit for bit (so -0 differs from +0), except that any NaN equals any NaN."""
    nan = want.isnan()
    if not torch.equal(got.isnan(), nan):
        return False
    bits = INT16 if got.element_size() == 2 else torch.int32
    return torch.equal(got[~nan].view(bits), want[~nan].view(bits))


def _run(kind, step_fn, numel, param_dtype, grad_dtype, state_dtype, adamw_mode, threads=None):
    gen = torch.Generator().manual_seed(numel)
    # Magnitudes from 1e-6 to 1e2: fp16 parameters include subnormals.
    scale = torch.logspace(-6, 2, numel)[torch.randperm(numel, generator=gen)]
    param = (torch.randn(numel, generator=gen) * scale).to(param_dtype)
    exp_avg = torch.zeros(numel, dtype=state_dtype)
    exp_avg_sq = torch.zeros(numel, dtype=state_dtype)
    for step in range(1, STEPS + 1):
        grad = torch.randn(numel, generator=gen).to(grad_dtype)
        if kind == "lion":
            step_fn(param, grad, exp_avg, **LION, num_threads=threads)
        else:
            step_fn(param, grad, exp_avg, exp_avg_sq, step=step, adamw_mode=adamw_mode, **ADAM,
                    num_threads=threads)  # fmt: skip
    return param, exp_avg, exp_avg_sq


CASES = [
    (kind, param_dtype, grad_dtype, state_dtype, adamw_mode)
    for param_dtype in SIXTEEN
    for grad_dtype, state_dtype in itertools.product(
        (torch.float32, torch.bfloat16, torch.float16), (torch.float32, param_dtype)
    )
    for kind, adamw_mode in (("adam", True), ("adam", False), ("lion", True))
]


@pytest.mark.parametrize("numel", [7, 64, 1031])
def test_every_path_equals_the_twin_bit_for_bit(simd_path, numel):
    for kind, param_dtype, grad_dtype, state_dtype, adamw_mode in CASES:
        ours = kernels.cpu_adam_step if kind == "adam" else kernels.cpu_lion_step
        twin = kernels.reference_adam_step if kind == "adam" else kernels.reference_lion_step
        dtypes = (param_dtype, grad_dtype, state_dtype)
        with kernels.use_simd_path(simd_path):
            got = _run(kind, ours, numel, *dtypes, adamw_mode)
        want = _run(kind, twin, numel, *dtypes, adamw_mode)
        case = f"{simd_path} {kind} w={adamw_mode} param={param_dtype} grad={grad_dtype} "
        case += f"state={state_dtype} n={numel}"
        assert got[0].dtype == param_dtype and got[1].dtype == state_dtype, case
        for name, a, b in zip(("param", "exp_avg", "exp_avg_sq"), got, want, strict=True):
            assert _same(a, b), f"{name} differs: {case}"


def test_thread_splits_do_not_change_the_result(simd_path):
    numel = 200_003  # several 64Ki-element blocks, so 3 threads really split the step
    for param_dtype in SIXTEEN:
        dtypes = (param_dtype, param_dtype, param_dtype)
        with kernels.use_simd_path(simd_path):
            one, three = (_run("adam", kernels.cpu_adam_step, numel, *dtypes, True, threads=t)
                          for t in (1, 3))  # fmt: skip
        for a, b in zip(one, three, strict=True):
            assert _same(a, b), f"{simd_path} {param_dtype}"


@pytest.mark.parametrize("param_dtype", SIXTEEN)
def test_every_bit_pattern_survives_a_step_that_keeps_it(simd_path, param_dtype):
    # lr = 0 and no weight decay: AdamW computes p * 1 - (0 * m) / denom with m = 0, which is p
    # for every p (NaN stays NaN, -0 stays -0), so the parameter shows load + store alone.
    param = _all_patterns(param_dtype).clone()
    want = param.clone()
    numel = param.numel()
    zeros = torch.zeros(numel, dtype=param_dtype)
    with kernels.use_simd_path(simd_path):
        kernels.cpu_adam_step(
            param, zeros, zeros.clone(), zeros.clone(), step=1, lr=0.0, beta1=0.9, beta2=0.999,
            eps=1e-8, weight_decay=0.0,
        )  # fmt: skip
    assert _same(param, want)


# Step sizes (exact in float32) that put p -/+ lr on the hard cases of the 16-bit rounding:
# 16 is half of fp16's spacing in [2^15, 65504], so p -/+ 16 are ties there and 65504 + 16 =
# 65520 is the overflow tie (-> inf); 3 * 2^-26 lands between fp16 subnormals (spacing 2^-24)
# and rounds them up, down and to zero; 2^-9 gives bf16 ties in [0.5, 1), fp16 ones in [4, 8).
LRS = (16.0, 3 * 2.0**-26, 2.0**-9)


@pytest.mark.parametrize("param_dtype", SIXTEEN)
def test_lion_step_rounds_like_torch(simd_path, param_dtype):
    # With beta1 = 0 and a zero momentum the direction is sign(g); with no weight decay
    # p_new = p - lr * sign(g): one float32 subtraction (correctly rounded, in torch as in the
    # kernels), then rounded to the parameter dtype.
    start = _all_patterns(param_dtype)
    numel = start.numel()
    gen = torch.Generator().manual_seed(3)
    grad = torch.randn(numel, generator=gen)
    for lr in LRS:
        param = start.clone()
        with kernels.use_simd_path(simd_path):
            kernels.cpu_lion_step(
                param, grad, torch.zeros(numel), lr=lr, beta1=0.0, beta2=0.99, weight_decay=0.0
            )
        want = (start.float() - lr * torch.sign(grad)).to(param_dtype)
        assert _same(param, want), f"{simd_path} {param_dtype} lr={lr}"
        if param_dtype == torch.float16 and lr == 16.0:
            assert bool(param.isinf().any()), "the overflow tie was not exercised"


@pytest.mark.parametrize("param_dtype", SIXTEEN)
def test_16_bit_moments_round_like_torch(simd_path, param_dtype):
    # With beta1 = 0 the new first moment is 0 * m + 1 * g, i.e. g (with -0 turned into +0), so
    # a float32 gradient of random bit patterns shows the moment store's rounding.
    gen = torch.Generator().manual_seed(4)
    bits = torch.randint(-(2**31), 2**31, (1 << 16,), generator=gen, dtype=torch.int64)
    grad = bits.to(torch.int32).view(torch.float32)
    numel = grad.numel()
    exp_avg = torch.zeros(numel, dtype=param_dtype)
    with kernels.use_simd_path(simd_path):
        kernels.cpu_adam_step(
            torch.zeros(numel, dtype=param_dtype), grad, exp_avg,
            torch.zeros(numel, dtype=param_dtype), step=1, lr=0.0, beta1=0.0, beta2=0.5, eps=1.0,
            weight_decay=0.0,
        )  # fmt: skip
    assert _same(exp_avg, (grad + 0.0).to(param_dtype))
