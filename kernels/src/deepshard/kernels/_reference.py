"""The pure-torch twins of the CPU optimizer kernels.

Each twin performs the kernel's float32 operations one torch op at a time, in the kernel's order
and with the kernel's float32 constants (`_constants`), so on the same inputs it produces the
same bits (NaN payloads aside); the parity tests check this. They run when the compiled
extension cannot be loaded, and on any device, just slower: temporaries instead of one pass.

16-bit tensors are handled as the kernels handle them: widened to float32 (exact), updated with
the same float32 operations, and written back with torch's rounding (``copy_`` into a bfloat16 or
float16 tensor rounds to nearest even, as the kernels' stores do). A float32 parameter is updated
in place by the float32 operations themselves.

One detail keeps them exact: torch's float32 ``sqrt`` on CPU is not always correctly rounded
(it may be 1 ulp off), while the kernels' is; the twins take the square root in float64 and round
once to float32, which gives the correctly rounded float32 square root.
"""

from __future__ import annotations

import torch

from deepshard.kernels._constants import adam_constants, lion_constants
from deepshard.kernels._validate import check_adam_args, check_lion_args

__all__ = ["reference_adam_step", "reference_lion_step", "run_reference_adam", "run_reference_lion"]


def _sqrt_f32(x: torch.Tensor) -> torch.Tensor:
    return x.double().sqrt_().float()


def _store(param: torch.Tensor, updated: torch.Tensor) -> None:
    """Writes the float32 result back into a 16-bit ``param`` (a float32 one already holds it)."""
    if updated is not param:
        param.copy_(updated)


def reference_adam_step(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    adamw_mode: bool = True,
    bias_correction: bool = True,
    param_out: torch.Tensor | None = None,
    num_threads: int | None = None,
) -> None:
    """One Adam/AdamW step in plain torch ops; same contract as `cpu_adam_step`.

    ``num_threads`` is accepted for signature parity and ignored (torch's own threads are used).
    """
    check_adam_args(
        param, grad, exp_avg, exp_avg_sq, param_out, step=step, lr=lr, beta1=beta1,
        beta2=beta2, eps=eps, weight_decay=weight_decay, num_threads=num_threads,
    )  # fmt: skip
    run_reference_adam(
        param, grad, exp_avg, exp_avg_sq, param_out, step=step, lr=lr, beta1=beta1,
        beta2=beta2, eps=eps, weight_decay=weight_decay, adamw_mode=adamw_mode,
        bias_correction=bias_correction,
    )  # fmt: skip


@torch.no_grad()
def run_reference_adam(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    param_out: torch.Tensor | None,
    *,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    adamw_mode: bool,
    bias_correction: bool,
) -> None:
    """The Adam twin without argument checks (the caller has checked)."""
    c = adam_constants(
        step=step, lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
        bias_correction=bias_correction,
    )  # fmt: skip
    p = param.float()  # param itself when float32, else a widened copy
    g = grad.float()
    if adamw_mode:
        p.mul_(c.decay)
    else:
        g = g + p * c.weight_decay
    m = exp_avg.float() * c.beta1 + g * c.one_minus_beta1
    v = exp_avg_sq.float() * c.beta2 + (g * c.one_minus_beta2) * g
    denom = _sqrt_f32(v) / c.bias_correction2_sqrt + c.eps
    p.sub_((m * c.step_size) / denom)
    _store(param, p)
    exp_avg.copy_(m)
    exp_avg_sq.copy_(v)
    if param_out is not None:
        param_out.copy_(p)


def reference_lion_step(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    weight_decay: float,
    param_out: torch.Tensor | None = None,
    num_threads: int | None = None,
) -> None:
    """One Lion step in plain torch ops; same contract as `cpu_lion_step`.

    ``num_threads`` is accepted for signature parity and ignored.
    """
    check_lion_args(
        param, grad, exp_avg, param_out, lr=lr, beta1=beta1, beta2=beta2,
        weight_decay=weight_decay, num_threads=num_threads,
    )  # fmt: skip
    run_reference_lion(
        param, grad, exp_avg, param_out, lr=lr, beta1=beta1, beta2=beta2,
        weight_decay=weight_decay,
    )  # fmt: skip


@torch.no_grad()
def run_reference_lion(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    param_out: torch.Tensor | None,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    weight_decay: float,
) -> None:
    """The Lion twin without argument checks (the caller has checked)."""
    c = lion_constants(lr=lr, beta1=beta1, beta2=beta2, weight_decay=weight_decay)
    p = param.float()
    g = grad.float()
    m = exp_avg.float()
    update = m * c.beta1 + g * c.one_minus_beta1
    p.mul_(c.decay).sub_(torch.sign(update) * c.lr)
    _store(param, p)
    exp_avg.copy_(m * c.beta2 + g * c.one_minus_beta2)
    if param_out is not None:
        param_out.copy_(p)
