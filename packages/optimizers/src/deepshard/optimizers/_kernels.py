"""Typed entry points to the compiled update kernels of ``deepshard.kernels``.

The kernels package loads a compiled extension when imported, so it is imported on the first
step rather than when this package is: ``import deepshard.optimizers`` stays cheap.
"""

from __future__ import annotations

import torch

__all__ = ["cpu_adam_step", "cpu_lion_step", "fused_adam_step"]


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
