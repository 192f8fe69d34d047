"""cpu_adam_step on every compiled SIMD path against its pure-torch twin and torch.optim.

Three references, from strict to loose:

1. ``reference_adam_step`` performs the kernel's float32 operations one torch op at a time, so
   every path must equal it bit for bit, for every dtype combination, for sizes that exercise the
   vector body and the scalar tail, and for any thread split.
2. ``torch.optim.AdamW`` / ``torch.optim.Adam`` (``adamw_mode=False``) on the same float32 data,
   10 steps. They are not bit-identical to the kernel: torch computes the first moment with
   ``lerp`` (an FMA), its float32 CPU ``sqrt`` may be 1 ulp off, and it rounds its constants from
   float64 (``1 - 0.999`` in float64 is 0.001, while the kernel's float32 ``1 - 0.999f`` is
   0.00099998713, 1.3e-5 away). The hyper-parameters below are float32 numbers so that last,
   systematic difference vanishes; what remains is a few ulps per step. Bound: the parameter
   rounds differently by at most ~1 ulp per step (10 steps: <= 1.2e-6 relative) and the update
   ``lr * m_hat / denom`` differs by ~1e-6 of ``lr`` per step where ``m`` cancels; hence
   ``rtol=2e-6, atol=2e-5 * lr``.
3. With bfloat16 moments, torch's float32 step applied to the moments widened to float32, then
   rounded back to bfloat16 (round to nearest even) -- derived below.
"""

from __future__ import annotations

import functools
import itertools

import pytest
import torch

import deepshard.kernels as kernels

# float32-exact hyper-parameters (see the module docstring).
LR = 0.0010000000474974513  # float32(1e-3)
BETA1 = 0.8999999761581421  # float32(0.9)
BETA2 = 0.9990000128746033  # float32(0.999)
EPS = 9.99999993922529e-09  # float32(1e-8)
WD = 0.009999999776482582  # float32(0.01)
STEPS = 10

GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@functools.lru_cache(maxsize=16)
def _grads(numel: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    # Magnitudes spread over 1e-6..1e1, so fp16 grads include subnormals.
    scale = torch.logspace(-6, 1, numel) if numel > 1 else torch.ones(1)
    scale = scale[torch.randperm(numel, generator=gen)]
    return tuple((torch.randn(numel, generator=gen) * scale).to(dtype) for _ in range(STEPS))


def _params(numel: int, seed: int) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(seed + 1))


@functools.lru_cache(maxsize=4)
def _twin(numel, grad_dtype, state_dtype, out_dtype, adamw_mode):
    return _run(kernels.reference_adam_step, numel, grad_dtype, state_dtype, out_dtype,
                adamw_mode=adamw_mode)  # fmt: skip


def _run(step_fn, numel, grad_dtype, state_dtype, out_dtype, *, adamw_mode, threads=None):
    param = _params(numel, 0)
    exp_avg = torch.zeros(numel, dtype=state_dtype)
    exp_avg_sq = torch.zeros(numel, dtype=state_dtype)
    out = None if out_dtype is None else torch.empty(numel, dtype=out_dtype)
    for step, grad in enumerate(_grads(numel, grad_dtype, 0), start=1):
        step_fn(
            param, grad, exp_avg, exp_avg_sq, step=step, lr=LR, beta1=BETA1, beta2=BETA2, eps=EPS,
            weight_decay=WD, adamw_mode=adamw_mode, param_out=out, num_threads=threads,
        )  # fmt: skip
    return param, exp_avg, exp_avg_sq, out


@pytest.mark.parametrize("numel", [7, 64, 1031])
def test_every_path_equals_the_twin_bit_for_bit(simd_path, numel):
    combos = itertools.product(
        GRAD_DTYPES, (torch.float32, torch.bfloat16), (None, torch.bfloat16, torch.float16)
    )
    for grad_dtype, state_dtype, out_dtype in combos:
        for adamw_mode in (True, False):
            with kernels.use_simd_path(simd_path):
                got = _run(kernels.cpu_adam_step, numel, grad_dtype, state_dtype, out_dtype,
                           adamw_mode=adamw_mode)  # fmt: skip
            want = _run(kernels.reference_adam_step, numel, grad_dtype, state_dtype, out_dtype,
                        adamw_mode=adamw_mode)  # fmt: skip
            case = f"{simd_path} {grad_dtype} state={state_dtype} out={out_dtype} w={adamw_mode}"
            for name, a, b in zip(("param", "exp_avg", "exp_avg_sq"), got, want, strict=False):
                assert torch.equal(a, b), f"{name} differs: {case}"
            if out_dtype is not None:
                assert torch.equal(got[3], want[3]), f"param_out differs: {case}"
                assert torch.equal(got[3], got[0].to(out_dtype)), f"param_out != param: {case}"


def test_thread_splits_do_not_change_the_result(simd_path):
    numel = 1_000_003
    dtypes = (torch.bfloat16, torch.float32, torch.bfloat16)
    with kernels.use_simd_path(simd_path):
        runs = [
            _run(kernels.cpu_adam_step, numel, *dtypes, adamw_mode=True, threads=threads)
            for threads in (1, 3)
        ]
    want = _twin(numel, torch.bfloat16, torch.float32, torch.bfloat16, True)
    for got in runs:
        for a, b in zip(got, want, strict=True):
            assert torch.equal(a, b)


# (weight decay, bias correction, AdamW mode): every pair of the three settings appears once.
SETTINGS = [(0.0, True, True), (WD, False, True), (WD, True, False), (0.0, False, False)]


@functools.lru_cache(maxsize=36)  # shared by every path
def _torch_adam(numel, grad_dtype, weight_decay, bias_correction, adamw_mode):
    param = _params(numel, 0)
    cls = torch.optim.AdamW if adamw_mode else torch.optim.Adam
    opt = cls([param], lr=LR, betas=(BETA1, BETA2), eps=EPS, weight_decay=weight_decay)
    if not bias_correction:
        # torch.optim has no switch for it; starting from a step count that makes
        # 1 - beta**step == 1 in float64 is the same thing.
        zeros = torch.zeros(numel)
        opt.state[param] = {
            "step": torch.tensor(1e9),
            "exp_avg": zeros,
            "exp_avg_sq": zeros.clone(),
        }
    for grad in _grads(numel, grad_dtype, 0):
        param.grad = grad.float()
        opt.step()
    state = opt.state[param]
    return param, state["exp_avg"], state["exp_avg_sq"]


def _ours(numel, grad_dtype, weight_decay, bias_correction, adamw_mode):
    param = _params(numel, 0)
    exp_avg, exp_avg_sq = torch.zeros(numel), torch.zeros(numel)
    for step, grad in enumerate(_grads(numel, grad_dtype, 0), start=1):
        kernels.cpu_adam_step(
            param, grad, exp_avg, exp_avg_sq, step=step, lr=LR, beta1=BETA1, beta2=BETA2, eps=EPS,
            weight_decay=weight_decay, adamw_mode=adamw_mode, bias_correction=bias_correction,
        )  # fmt: skip
    return param, exp_avg, exp_avg_sq


@pytest.mark.parametrize("numel", [7, 64, 1_000_003])
def test_every_path_matches_torch_optim(simd_path, numel):
    # The small sizes run every gradient dtype with every setting. At 1_000_003 each dtype runs
    # one setting, chosen so each switch is seen both ways; the twin test above proves the paths
    # agree on everything else.
    if numel < 1000:
        cases = list(itertools.product(GRAD_DTYPES, SETTINGS))
    else:
        cases = list(zip(GRAD_DTYPES, (SETTINGS[0], SETTINGS[2], SETTINGS[1]), strict=True))
    for grad_dtype, (weight_decay, bias_correction, adamw_mode) in cases:
        with kernels.use_simd_path(simd_path):
            param, exp_avg, exp_avg_sq = _ours(
                numel, grad_dtype, weight_decay, bias_correction, adamw_mode
            )
        want = _torch_adam(numel, grad_dtype, weight_decay, bias_correction, adamw_mode)
        msg = f"{simd_path} {grad_dtype} wd={weight_decay} bc={bias_correction} w={adamw_mode}"
        torch.testing.assert_close(param, want[0], rtol=2e-6, atol=2e-5 * LR, msg=msg)
        # Moments: lerp vs mul-add rounds differently; where m cancels, only absolutely close.
        torch.testing.assert_close(exp_avg, want[1], rtol=1e-5, atol=1e-6 * 10.0, msg=msg)
        torch.testing.assert_close(exp_avg_sq, want[2], rtol=1e-5, atol=0.0, msg=msg)
