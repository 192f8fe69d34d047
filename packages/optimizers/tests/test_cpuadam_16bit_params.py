"""CPUAdam, Adam(impl="cpu") and Lion(impl="cpu") update bf16/fp16 CPU models in place.

As DeepSpeedCPUAdam: the kernel reads the 16-bit parameters and gradients as fp32, does fp32
math and rounds the parameters back once per step; the moments are fp32, or with
``fp32_optimizer_states=False`` the parameter's dtype.

The reference is torch's own fp32 step, derived independently of the kernel. At every step both
sides start from the same state -- the kernel's current 16-bit parameters, widened, and its
current moments, widened -- and torch.optim.AdamW's fp32 result is rounded to the kernel's
dtypes with ``.to``. Comparing one step at a time keeps differences from compounding, so per
step the two differ only by fp32 noise (torch's ``lerp``, float64 constants and 1-ulp ``sqrt``
against the kernel's float32 operations; the hyper-parameters are float32 numbers so the
constants agree): a few fp32 ulps of the parameter's terms plus ~1e-6 lr where the first moment
cancels. Rounded to 16 bits, that changes the result only where the fp32 value lies within that
noise of a rounding boundary -- rare, if more often than chance because 16-bit products land on
exact midpoints (the test allows one element plus 1% per tensor and step), and there by one ulp
of the 16-bit dtype.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from deepshard.kernels import _extension
from deepshard.optimizers import Adam, CPUAdam, Lion

LR = 0.009999999776482582  # float32(1e-2): large enough to move bf16 parameters every step
BETA1, BETA2 = 0.8999999761581421, 0.9990000128746033  # float32(0.9), float32(0.999)
EPS = 9.99999993922529e-09  # float32(1e-8)
WD = 0.009999999776482582  # float32(0.01)
STEPS = 6
SIXTEEN = (torch.bfloat16, torch.float16)


def _model(dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(33, 65), torch.nn.Tanh(), torch.nn.Linear(65, 9)).to(
        dtype
    )


def _backward(model: torch.nn.Module, dtype: torch.dtype, step: int) -> None:
    gen = torch.Generator().manual_seed(step)
    inputs = torch.randn(16, 33, generator=gen).to(dtype)
    target = torch.randn(16, 9, generator=gen).to(dtype)
    model.zero_grad(set_to_none=True)
    torch.nn.functional.mse_loss(model(inputs).float(), target.float()).backward()


def _ulp(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Spacing of ``dtype`` numbers at |x| (8 significant bits for bf16, 11 for fp16)."""
    bits, smallest = (8, 2.0**-133) if dtype == torch.bfloat16 else (11, 2.0**-24)
    _, exponent = torch.frexp(x.float())
    return torch.ldexp(torch.ones_like(x, dtype=torch.float32), exponent - bits).clamp(smallest)


def _assert_rounded_close(got: torch.Tensor, want: torch.Tensor, noise: torch.Tensor, what: str):
    differ = got.float() != want.float()
    if got.dtype != torch.float32:
        allowed = 1 + 0.01 * got.numel()
        assert differ.sum().item() <= allowed, f"{what}: too many roundings differ"
        noise = noise + torch.maximum(_ulp(got, got.dtype), _ulp(want, got.dtype))
    gap = (got.float() - want.float()).abs()
    assert bool((gap[differ] <= noise[differ]).all()), f"{what}: differs beyond the bound"


def _torch_step(param, grad, state, step: int):
    """torch.optim.AdamW's fp32 step ``step`` from the kernel's state; returns (p, m, v)."""
    widened = torch.nn.Parameter(param.detach().float())
    opt = torch.optim.AdamW([widened], lr=LR, betas=(BETA1, BETA2), eps=EPS, weight_decay=WD)
    opt.state[widened] = {
        "step": torch.tensor(float(step - 1)),
        "exp_avg": state["exp_avg"].clone(),
        "exp_avg_sq": state["exp_avg_sq"].clone(),
    }
    widened.grad = grad.float()
    opt.step()
    new = opt.state[widened]
    return widened.detach(), new["exp_avg"], new["exp_avg_sq"]


@pytest.mark.parametrize("fp32_states", [True, False], ids=["fp32-states", "16-bit-states"])
@pytest.mark.parametrize("dtype", SIXTEEN, ids=["bf16", "fp16"])
def test_cpuadam_matches_fp32_math_rounded_each_step(dtype, fp32_states):
    model = _model(dtype)
    params = list(model.parameters())
    opt = CPUAdam(params, lr=LR, betas=(BETA1, BETA2), eps=EPS, weight_decay=WD,
                  fp32_optimizer_states=fp32_states)  # fmt: skip
    state_dtype = torch.float32 if fp32_states else dtype
    for step in range(1, STEPS + 1):
        _backward(model, dtype, step)
        olds = [_state_of(opt, p) for p in params]
        wants = [_torch_step(p, p.grad, old, step) for p, old in zip(params, olds, strict=True)]
        before = [p.detach().clone() for p in params]
        opt.step()
        for i, (param, old, want) in enumerate(zip(params, olds, wants, strict=True)):
            state, what = opt.state[param], f"{dtype} param {i} step {step}"
            assert param.dtype == dtype and state["exp_avg"].dtype == state_dtype, what
            assert not torch.equal(param.detach(), before[i]), f"{what}: nothing moved"
            _check_step(param, old, state, want, what)


def _state_of(opt: torch.optim.Optimizer, param: torch.Tensor) -> dict[str, torch.Tensor]:
    state = opt.state.get(param)
    if not state:
        return {"exp_avg": torch.zeros(param.shape), "exp_avg_sq": torch.zeros(param.shape)}
    # Copies: torch's step below updates the moments it is given in place.
    return {key: state[key].to(torch.float32, copy=True) for key in ("exp_avg", "exp_avg_sq")}


def _check_step(param, old, state, want, what: str) -> None:
    """The bounds of the module docstring, from the fp32 sizes of each update's terms."""
    want_p, want_m, want_v = want
    ulps = 4 * 2.0**-24  # a few fp32 ulps, relative to the terms
    p_noise = ulps * _magnitude(param, want_p) + 2e-6 * LR
    _assert_rounded_close(param.detach(), want_p.to(param.dtype), p_noise, f"{what} p")
    g = param.grad.float().abs()
    m_terms = BETA1 * old["exp_avg"].abs() + (1 - BETA1) * g
    m_dtype = state["exp_avg"].dtype
    _assert_rounded_close(state["exp_avg"], want_m.to(m_dtype), ulps * m_terms, f"{what} m")
    v_terms = BETA2 * old["exp_avg_sq"] + (1 - BETA2) * g * g
    _assert_rounded_close(state["exp_avg_sq"], want_v.to(m_dtype), ulps * v_terms, f"{what} v")


def _magnitude(param: torch.Tensor, want_p: torch.Tensor) -> torch.Tensor:
    """|p| on either side of the step (the decayed and updated parameter's size)."""
    return torch.maximum(param.detach().float().abs(), want_p.abs())


@pytest.mark.parametrize("dtype", SIXTEEN, ids=["bf16", "fp16"])
def test_state_dtypes_follow_fp32_optimizer_states(dtype):
    for fp32_states, want in ((True, torch.float32), (False, dtype)):
        for make in (
            lambda ps, f=fp32_states: CPUAdam(ps, fp32_optimizer_states=f),
            lambda ps, f=fp32_states: Adam(ps, impl="cpu", fp32_optimizer_states=f),
            lambda ps, f=fp32_states: Lion(ps, impl="cpu", fp32_optimizer_states=f),
        ):
            model = _model(dtype)
            opt = make(list(model.parameters()))
            _backward(model, dtype, 1)
            opt.step()
            for param in model.parameters():
                assert param.dtype == dtype
                assert {t.dtype for t in opt.state[param].values() if torch.is_tensor(t)} == {want}


def _trained(make, dtype: torch.dtype) -> list[torch.Tensor]:
    model = _model(dtype)
    opt = make(list(model.parameters()))
    for step in range(1, 4):
        _backward(model, dtype, step)
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


MAKERS = {
    "cpuadam": lambda ps: CPUAdam(ps, lr=LR, weight_decay=WD),
    "cpuadam-16-bit-states": lambda ps: CPUAdam(ps, lr=LR, fp32_optimizer_states=False),
    "lion": lambda ps: Lion(ps, lr=1e-3, weight_decay=0.1, impl="cpu"),
}


@pytest.mark.parametrize("kind", sorted(MAKERS))
@pytest.mark.parametrize("dtype", SIXTEEN, ids=["bf16", "fp16"])
def test_without_the_extension_the_twin_takes_the_same_steps(monkeypatch, dtype, kind):
    compiled = _trained(MAKERS[kind], dtype)
    if _extension.CPU_EXTENSION.get() is None:
        pytest.skip("the compiled extension is unavailable here; this run used the twin")
    missing = _extension.ExtensionLoader("deepshard.kernels._no_such_extension")
    monkeypatch.setattr(_extension, "CPU_EXTENSION", missing)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fallback = _trained(MAKERS[kind], dtype)
    assert any("pure-torch reference" in str(w.message) for w in caught)
    for a, b in zip(compiled, fallback, strict=True):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))
