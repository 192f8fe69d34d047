"""Entry points to the update kernels of ``deepshard.kernels``, one name per route.

The optimizers call the kernels through this module's names (tests count the calls by patching
them). Importing ``deepshard.kernels`` loads no compiled extension (its ops load one on first
use); the foreach twins are the kernels package's own functions, one copy of the dtype-general
update rather than one per package.
"""

from __future__ import annotations

import torch

from deepshard.kernels import foreach_adam_step, foreach_lion_step

__all__ = [
    "cpu_adam_step",
    "cpu_lion_step",
    "foreach_adam_step",
    "foreach_lion_step",
    "fused_adam_step",
]


def cpu_adam_step(
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
    adamw_mode: bool,
    bias_correction: bool,
    num_threads: int | None,
) -> None:
    """One Adam step on one contiguous fp32/bf16/fp16 CPU tensor, in place (the SIMD kernel)."""
    from deepshard.kernels import cpu_adam_step as kernel

    kernel(
        param,
        grad,
        exp_avg,
        exp_avg_sq,
        step=step,
        lr=lr,
        beta1=beta1,
        beta2=beta2,
        eps=eps,
        weight_decay=weight_decay,
        adamw_mode=adamw_mode,
        bias_correction=bias_correction,
        num_threads=num_threads,
    )


def cpu_lion_step(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    weight_decay: float,
    num_threads: int | None,
) -> None:
    """One Lion step on one contiguous fp32/bf16/fp16 CPU tensor, in place (the SIMD kernel)."""
    from deepshard.kernels import cpu_lion_step as kernel

    kernel(
        param,
        grad,
        exp_avg,
        lr=lr,
        beta1=beta1,
        beta2=beta2,
        weight_decay=weight_decay,
        num_threads=num_threads,
    )


def fused_adam_step(
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
    """One Adam step over many tensors of one device (multi-tensor CUDA kernel or its twin)."""
    from deepshard.kernels import fused_adam_step as kernel

    kernel(
        params,
        grads,
        exp_avgs,
        exp_avg_sqs,
        step=step,
        lr=lr,
        beta1=beta1,
        beta2=beta2,
        eps=eps,
        weight_decay=weight_decay,
        adamw_mode=adamw_mode,
        bias_correction=bias_correction,
    )
