"""The torch twin of the fused Adam step matches torch.optim on CPU, and the op behaves.

`reference_fused_adam_step` (what `fused_adam_step` runs on CPU, and on CUDA without the kernel)
is compared with ``torch.optim.AdamW`` / ``torch.optim.Adam`` over several tensors of sizes
7, 64 and 1_000_003 for 10 steps, with fp32 and bf16 gradients (torch gets the same bf16
values widened to fp32, since its params and grads must share a dtype), weight decay on and off.
torch has no switch for bias correction, so "off" is checked against a float64 transcription of
the update rule, which is itself first checked against torch with bias correction on.
"""

from __future__ import annotations

import math
import subprocess
import sys
import warnings
from collections.abc import Callable

import pytest
import torch

from deepshard.kernels import _extension, _fused_adam
from deepshard.kernels._fused_adam import fused_adam_step, reference_fused_adam_step

SIZES = (7, 64, 1_000_003)
STEPS = 10
HYPER = {"lr": 1e-2, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8}

Step = Callable[..., None]


def _start(
    dtype: torch.dtype, seed: int = 0
) -> tuple[list[torch.Tensor], list[list[torch.Tensor]]]:
    """Initial params and, per step, one grad per param (rounded to `dtype`)."""
    gen = torch.Generator().manual_seed(seed)
    params = [torch.randn(n, generator=gen) for n in SIZES]
    grads = [[torch.randn(n, generator=gen).to(dtype) for n in SIZES] for _ in range(STEPS)]
    return params, grads


def _run_twin(
    step_fn: Step,
    params: list[torch.Tensor],
    grads: list[list[torch.Tensor]],
    *,
    weight_decay: float,
    adamw_mode: bool,
    bias_correction: bool = True,
) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    params = [p.clone() for p in params]
    exp_avgs = [torch.zeros_like(p) for p in params]
    exp_avg_sqs = [torch.zeros_like(p) for p in params]
    for step, step_grads in enumerate(grads, start=1):
        step_fn(
            params,
            step_grads,
            exp_avgs,
            exp_avg_sqs,
            step=step,
            weight_decay=weight_decay,
            adamw_mode=adamw_mode,
            bias_correction=bias_correction,
            **HYPER,
        )
    return params, exp_avgs, exp_avg_sqs


def _run_torch(
    params: list[torch.Tensor],
    grads: list[list[torch.Tensor]],
    *,
    weight_decay: float,
    adamw_mode: bool,
    foreach: bool,
) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    leaves = [torch.nn.Parameter(p.clone()) for p in params]
    kind = torch.optim.AdamW if adamw_mode else torch.optim.Adam
    betas = (HYPER["beta1"], HYPER["beta2"])
    opt = kind(
        leaves,
        lr=HYPER["lr"],
        betas=betas,
        eps=HYPER["eps"],
        weight_decay=weight_decay,
        foreach=foreach,
    )
    for step_grads in grads:
        for leaf, grad in zip(leaves, step_grads, strict=True):
            leaf.grad = grad.to(torch.float32)
        opt.step()
    states = [opt.state[leaf] for leaf in leaves]
    return (
        [leaf.detach() for leaf in leaves],
        [s["exp_avg"] for s in states],
        [s["exp_avg_sq"] for s in states],
    )


def _run_float64(
    params: list[torch.Tensor],
    grads: list[list[torch.Tensor]],
    *,
    weight_decay: float,
    adamw_mode: bool,
    bias_correction: bool,
) -> list[torch.Tensor]:
    """The update rule written out per tensor in float64 (the independent reference)."""
    lr, beta1, beta2, eps = HYPER["lr"], HYPER["beta1"], HYPER["beta2"], HYPER["eps"]
    out = []
    for i, p32 in enumerate(params):
        p = p32.double()
        m = torch.zeros_like(p)
        v = torch.zeros_like(p)
        for step, step_grads in enumerate(grads, start=1):
            g = step_grads[i].double()
            if adamw_mode:
                p = p * (1 - lr * weight_decay)
            else:
                g = g + weight_decay * p
            m = beta1 * m + (1 - beta1) * g
            v = beta2 * v + (1 - beta2) * g * g
            bc1 = 1 - beta1**step if bias_correction else 1.0
            bc2 = 1 - beta2**step if bias_correction else 1.0
            p = p - lr / bc1 * m / (v.sqrt() / math.sqrt(bc2) + eps)
        out.append(p)
    return out


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("weight_decay", [0.0, 0.1], ids=["no_wd", "wd"])
@pytest.mark.parametrize("adamw_mode", [True, False], ids=["adamw", "adam_l2"])
def test_twin_matches_torch_optim(
    grad_dtype: torch.dtype, weight_decay: float, adamw_mode: bool
) -> None:
    params, grads = _start(grad_dtype)
    got = _run_twin(
        reference_fused_adam_step,
        params,
        grads,
        weight_decay=weight_decay,
        adamw_mode=adamw_mode,
    )
    # The twin runs torch's own foreach sequence: identical to the last bit.
    want = _run_torch(params, grads, weight_decay=weight_decay, adamw_mode=adamw_mode, foreach=True)
    for got_list, want_list in zip(got, want, strict=True):
        for g, w in zip(got_list, want_list, strict=True):
            torch.testing.assert_close(g, w, rtol=0, atol=0)
    # The per-tensor implementation rounds the same operations in another order at most.
    single = _run_torch(
        params, grads, weight_decay=weight_decay, adamw_mode=adamw_mode, foreach=False
    )
    for got_list, want_list in zip(got, single, strict=True):
        for g, w in zip(got_list, want_list, strict=True):
            torch.testing.assert_close(g, w)


@pytest.mark.parametrize("bias_correction", [True, False], ids=["bias_corr", "no_bias_corr"])
@pytest.mark.parametrize("adamw_mode", [True, False], ids=["adamw", "adam_l2"])
def test_twin_matches_float64_rule(bias_correction: bool, adamw_mode: bool) -> None:
    params, grads = _start(torch.bfloat16, seed=1)
    got, _, _ = _run_twin(
        reference_fused_adam_step,
        params,
        grads,
        weight_decay=0.1,
        adamw_mode=adamw_mode,
        bias_correction=bias_correction,
    )
    want = _run_float64(
        params, grads, weight_decay=0.1, adamw_mode=adamw_mode, bias_correction=bias_correction
    )
    # fp32 against float64: where a gradient nearly cancels (g + wd*p ~ 0 in L2 mode), its
    # rounding error is blown up by the scale-free m / sqrt(v), so a rare element may be off by
    # a small fraction of one step (lr). Mistakes in the rule are off by whole steps.
    tolerance = {"rtol": 1e-5, "atol": HYPER["lr"] / 100}
    if bias_correction:  # the float64 rule is torch's rule: check the reference itself first
        torch_params, _, _ = _run_torch(
            params, grads, weight_decay=0.1, adamw_mode=adamw_mode, foreach=False
        )
        for t, w in zip(torch_params, want, strict=True):
            torch.testing.assert_close(t.double(), w, **tolerance)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g.double(), w, **tolerance)
    # Without bias correction the early steps are much smaller: the switch really acts.
    other, _, _ = _run_twin(
        reference_fused_adam_step,
        params,
        grads,
        weight_decay=0.1,
        adamw_mode=adamw_mode,
        bias_correction=not bias_correction,
    )
    assert not torch.allclose(other[0], got[0], rtol=1e-4, atol=1e-5)


def test_fused_step_on_cpu_is_the_twin_without_warning() -> None:
    params, grads = _start(torch.bfloat16, seed=2)
    want = _run_twin(reference_fused_adam_step, params, grads, weight_decay=0.1, adamw_mode=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = _run_twin(fused_adam_step, params, grads, weight_decay=0.1, adamw_mode=True)
    for got_list, want_list in zip(got, want, strict=True):
        for g, w in zip(got_list, want_list, strict=True):
            torch.testing.assert_close(g, w, rtol=0, atol=0)


def test_fused_step_updates_parameters_that_require_grad() -> None:
    param = torch.nn.Parameter(torch.ones(5))
    grad = torch.full((5,), 0.5)
    fused_adam_step(
        [param],
        [grad],
        [torch.zeros(5)],
        [torch.zeros(5)],
        step=1,
        weight_decay=0.0,
        **HYPER,
    )
    # Step 1 with bias correction moves every element by lr * sign(grad) (up to eps).
    torch.testing.assert_close(param.detach(), torch.full((5,), 1 - HYPER["lr"]))


def test_op_is_registered_and_passes_opcheck() -> None:
    gen = torch.Generator().manual_seed(3)
    params = [torch.randn(7, generator=gen), torch.randn(3, 4, generator=gen)]
    grads = [torch.randn(7, generator=gen).half(), torch.randn(3, 4, generator=gen)]
    moments = [torch.zeros_like(p) for p in params]
    squares = [torch.zeros_like(p) for p in params]
    args = (params, grads, moments, squares, 3, 1e-3, 0.9, 0.999, 1e-8, 0.01, True, True)
    torch.library.opcheck(torch.ops.deepshard.fused_adam_step.default, args)


def test_bad_arguments_raise_errors_that_name_them() -> None:
    p, g, m, v = (torch.zeros(4) for _ in range(4))
    kw = {"step": 1, "weight_decay": 0.0, **HYPER}
    cases: list[tuple[type[Exception], str, tuple[list[torch.Tensor], ...], dict[str, float]]] = [
        (ValueError, "1 params, 0 grads", ([p], [], [m], [v]), {}),
        (TypeError, "exp_avgs[0]", ([p], [g], [m.double()], [v]), {}),
        (TypeError, "grads[0]", ([p], [g.to(torch.int32)], [m], [v]), {}),
        (ValueError, "grads[0]", ([p], [torch.zeros(5)], [m], [v]), {}),
        (ValueError, "contiguous", ([torch.zeros(4, 2).t()], [g], [m], [v]), {}),
        (ValueError, "`step`", ([p], [g], [m], [v]), {"step": 0}),
        (ValueError, "`beta2`", ([p], [g], [m], [v]), {"beta2": 1.0}),
        (ValueError, "`lr`", ([p], [g], [m], [v]), {"lr": math.nan}),
    ]
    for error, fragment, lists, override in cases:
        for fn in (fused_adam_step, reference_fused_adam_step):
            with pytest.raises(error, match=fragment.replace("[", r"\[").replace("]", r"\]")):
                fn(*lists, **{**kw, **override})


def test_cuda_fallback_warns_once_with_the_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    # No GPU here: exercise the decision with the loader reporting the module missing.
    missing = _extension.ExtensionLoader("deepshard.kernels._no_such_cuda", hint="not built (test)")
    monkeypatch.setattr(_fused_adam, "CUDA_EXTENSION", missing)
    _fused_adam._warn_kernel_unavailable.cache_clear()
    try:
        with pytest.warns(RuntimeWarning, match=r"not built \(test\)") as record:
            for _ in range(3):
                assert _fused_adam._cuda_module_for(torch.device("cuda", 0)) is None
        assert len(record) == 1
    finally:
        _fused_adam._warn_kernel_unavailable.cache_clear()


@pytest.mark.parametrize(
    ("architectures", "capability", "runs"),
    [
        ("80,90", 80, True),
        ("80,90", 86, True),  # sm_80 machine code runs on sm_86
        ("80,90", 75, False),  # nothing old enough for Turing
        ("80,90", 100, True),  # compute_90 PTX is compiled by the driver for Blackwell
        ("80-real,90-real", 100, False),  # machine code only: no PTX to compile
        ("90-virtual", 90, True),
        ("90a", 90, True),
        ("90a", 100, False),  # arch-specific code runs on its own GPU only
        ("100f", 103, True),  # family-specific code runs across its family
        ("100f", 120, False),
        ("native", 75, True),  # unknown spelling: trusted, a failed launch still raises
    ],
)
def test_architecture_coverage(architectures: str, capability: int, runs: bool) -> None:
    assert _fused_adam._architectures_cover(architectures, capability) is runs


def test_status_is_a_bool_and_a_reason() -> None:
    compiled, description = _fused_adam.fused_adam_status()
    assert isinstance(compiled, bool)
    assert description
    if compiled:
        assert "CUDA architectures" in description
    else:
        assert "nvcc" in description


def test_importing_the_package_does_not_load_the_cuda_module() -> None:
    code = (
        "import sys, deepshard.kernels as k; "
        "assert 'deepshard.kernels._cuda' not in sys.modules, 'loaded at import'; "
        "k.fused_adam_status(); print('ok')"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"
