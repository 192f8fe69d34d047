"""Adam and Lion written with ``torch._foreach_*`` ops: any device, any floating dtype.

The dtype-general pure-torch twin of the multi-tensor kernels: `fused_adam_step` runs it where
no compiled kernel serves the tensors, and deepshard-optimizers' ``impl="foreach"`` calls it
(one copy of the update, not one per package). Each tensor is
updated in its compute dtype (fp32, or fp64 for fp64 parameters): 16-bit parameters, gradients
and moments are widened for the arithmetic and written back rounded, so a bf16 gradient on an
fp32 parameter gives the same step as its exact fp32 value. The formulas and the order of the
operations follow ``torch.optim.Adam``/``AdamW``, so results agree with them to the last bit
where the dtypes are the same.
"""

from __future__ import annotations

import torch

from deepshard.kernels._constants import bias_corrections

__all__ = ["compute_dtype", "foreach_adam_step", "foreach_lion_step"]


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype an update of a ``dtype`` tensor is computed in: fp64 stays, others use fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _widened(tensors: list[torch.Tensor], like: list[torch.Tensor]) -> list[torch.Tensor]:
    out = []
    for tensor, reference in zip(tensors, like, strict=True):
        target = compute_dtype(reference.dtype)
        out.append(tensor if tensor.dtype == target else tensor.to(target))
    return out


def _write_back(targets: list[torch.Tensor], values: list[torch.Tensor]) -> None:
    for target, value in zip(targets, values, strict=True):
        if value is not target:
            target.copy_(value)


def foreach_adam_step(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
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
    """One Adam (``adamw_mode=False``) or AdamW step over tensors of one device, in place.

    No argument checks: the callers (`fused_adam_step`, the optimizers) have checked.

    Args:
        params: Parameters, updated in place.
        grads: Their gradients, any floating dtype.
        exp_avgs: First moments, updated in place.
        exp_avg_sqs: Second moments, updated in place.
        step: The 1-based step count, for bias correction.
        lr: Learning rate.
        beta1: First-moment decay.
        beta2: Second-moment decay.
        eps: Added to the denominator.
        weight_decay: Decoupled (AdamW) or L2 added to the gradient (Adam).
        adamw_mode: Decoupled weight decay.
        bias_correction: Divide the moments by ``1 - beta**step``.
    """
    if not params:
        return
    p = _widened(params, params)
    g = _widened(grads, params)
    m = _widened(exp_avgs, params)
    v = _widened(exp_avg_sqs, params)
    if weight_decay != 0.0 and not adamw_mode:
        g = list(torch._foreach_add(g, p, alpha=weight_decay))
    torch._foreach_lerp_(m, g, 1.0 - beta1)
    torch._foreach_mul_(v, beta2)
    torch._foreach_addcmul_(v, g, g, value=1.0 - beta2)
    bias1, bias2_sqrt = bias_corrections(step, beta1, beta2, bias_correction)
    denom = torch._foreach_sqrt(v)
    torch._foreach_div_(denom, bias2_sqrt)
    torch._foreach_add_(denom, eps)
    if weight_decay != 0.0 and adamw_mode:
        torch._foreach_mul_(p, 1.0 - lr * weight_decay)
    torch._foreach_addcdiv_(p, m, denom, value=-lr / bias1)
    _write_back(params, p)
    _write_back(exp_avgs, m)
    _write_back(exp_avg_sqs, v)


def foreach_lion_step(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    *,
    lr: float,
    beta1: float,
    beta2: float,
    weight_decay: float,
) -> None:
    """One Lion step over tensors of one device, in place.

    ``c = beta1*m + (1-beta1)*g``; ``p = p*(1 - lr*wd) - lr*sign(c)``;
    ``m = beta2*m + (1-beta2)*g``.
    """
    if not params:
        return
    p = _widened(params, params)
    g = _widened(grads, params)
    m = _widened(exp_avgs, params)
    direction = torch._foreach_lerp(m, g, 1.0 - beta1)
    torch._foreach_sign_(direction)
    if weight_decay != 0.0:
        torch._foreach_mul_(p, 1.0 - lr * weight_decay)
    torch._foreach_add_(p, direction, alpha=-lr)
    torch._foreach_lerp_(m, g, 1.0 - beta2)
    _write_back(params, p)
    _write_back(exp_avgs, m)
