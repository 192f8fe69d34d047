"""Adam and AdamW (`Adam`, `AdamW`) and the CPU-kernel variant `CPUAdam`.

One class covers both algorithms, as DeepSpeed's FusedAdam and DeepSpeedCPUAdam do:
``adam_w_mode=True`` (the default) decays the weights directly (AdamW, ``p *= 1 - lr*wd``),
``adam_w_mode=False`` adds ``wd * p`` to the gradient (classic Adam with L2). With
``m`` and ``v`` the moments and ``t`` the step::

    m = beta1*m + (1-beta1)*g;  v = beta2*v + (1-beta2)*g*g
    p -= lr / (1-beta1**t) * m / (sqrt(v) / sqrt(1-beta2**t) + eps)

Without ``bias_correction`` both ``1 - beta**t`` factors are 1. ``impl`` chooses who computes
it: the CPU SIMD kernel, the fused multi-tensor kernel, or ``torch._foreach`` ops (see
``deepshard.optimizers._adam_step``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from deepshard.interface.errors import ConfigError
from deepshard.optimizers._adam_step import (
    ADAM_IMPLS,
    CPU_KERNEL_MOMENTS,
    AdamSettings,
    adam_step,
)
from deepshard.optimizers._checks import check_betas, check_choice, check_hyperparameters
from deepshard.optimizers._state import restore_saved_dtypes

__all__ = ["Adam", "AdamW", "CPUAdam"]

ParamsT = Iterable[torch.Tensor] | Iterable[dict[str, Any]] | Iterable[tuple[str, torch.Tensor]]


def _refuse_amsgrad(amsgrad: bool, owner: str) -> None:
    if amsgrad:
        message = (
            f"{owner} does not implement the AMSGrad variant (DeepSpeed's Adam optimizers do "
            "not either); set amsgrad to false, or use torch.optim.Adam(amsgrad=True)"
        )
        raise ConfigError.from_problems([("amsgrad", message)])


class Adam(torch.optim.Optimizer):
    """Adam/AdamW with a CPU kernel, a fused kernel and a ``torch._foreach`` implementation.

    Args:
        params: Parameters, ``(name, parameter)`` pairs or param groups; a group's own ``lr``,
            ``betas``, ``eps``, ``weight_decay``, ``bias_correction`` and ``adam_w_mode`` win.
        lr: Learning rate.
        bias_correction: Divide the moments by ``1 - beta**step``.
        betas: Decay rates of the first and second moments.
        eps: Added to the denominator.
        adam_w_mode: Decoupled weight decay (AdamW, the default) or L2 on the gradient (Adam).
        weight_decay: Weight decay coefficient.
        amsgrad: Must be False; AMSGrad is not implemented.
        impl: ``"auto"`` (CPU kernel for contiguous fp32/bf16/fp16 CPU parameters, fused kernel
            for fp32 CUDA ones, foreach otherwise), ``"cpu"``, ``"fused"`` or ``"foreach"``.
        fp32_optimizer_states: Keep the moments in fp32; False keeps them in 16 bits (the
            parameter's dtype when 16-bit, else bf16).
        num_threads: Threads of the CPU kernel (``None``: its default).

    Raises:
        ConfigError: A hyperparameter out of range, ``amsgrad=True`` or an unknown ``impl``.
    """

    zero_safe = True
    """The update is element-wise, so ZeRO may step flat partitions of it (`AdamW` and
    `CPUAdam` inherit this)."""

    def __init__(
        self,
        params: ParamsT,
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        adam_w_mode: bool = True,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        *,
        impl: str = "auto",
        fp32_optimizer_states: bool = True,
        num_threads: int | None = None,
    ) -> None:
        _refuse_amsgrad(amsgrad, type(self).__name__)
        self.impl = check_choice("impl", impl, ADAM_IMPLS)
        self.fp32_optimizer_states = bool(fp32_optimizer_states)
        self.num_threads = num_threads
        defaults = {
            "lr": lr,
            "betas": betas,
            "eps": eps,
            "weight_decay": weight_decay,
            "bias_correction": bias_correction,
            "adam_w_mode": adam_w_mode,
        }
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Adds a group, filling unset values from the defaults and checking them."""
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        group["betas"] = check_betas(group["betas"])
        check_hyperparameters(lr=group["lr"], eps=group["eps"], weight_decay=group["weight_decay"])

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads a state dict, keeping the dtype each moment was saved in (fp32 stays fp32)."""
        super().load_state_dict(state_dict)
        restore_saved_dtypes(self, state_dict)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Performs one optimization step.

        Args:
            closure: Re-evaluates the model and returns the loss (optional).

        Returns:
            The closure's loss, or None without a closure.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            adam_step(
                group["params"],
                self.state,
                AdamSettings.from_group(group, adamw_mode=True),
                impl=self.impl,
                fp32_optimizer_states=self.fp32_optimizer_states,
                num_threads=self.num_threads,
                owner=type(self).__name__,
            )
        return loss


class AdamW(Adam):
    """`Adam` with decoupled weight decay, the same optimizer with ``adam_w_mode=True``.

    Takes the arguments of `Adam` except ``adam_w_mode``.
    """

    def __init__(
        self,
        params: ParamsT,
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        *,
        impl: str = "auto",
        fp32_optimizer_states: bool = True,
        num_threads: int | None = None,
    ) -> None:
        super().__init__(
            params,
            lr=lr,
            bias_correction=bias_correction,
            betas=betas,
            eps=eps,
            adam_w_mode=True,
            weight_decay=weight_decay,
            amsgrad=amsgrad,
            impl=impl,
            fp32_optimizer_states=fp32_optimizer_states,
            num_threads=num_threads,
        )


class CPUAdam(Adam):
    """Adam/AdamW on the CPU SIMD kernel, with DeepSpeedCPUAdam's constructor arguments.

    Every parameter must be a contiguous fp32, bf16 or fp16 CPU tensor: an fp32 master copy
    (ZeRO optimizer offload keeps one) or, as with DeepSpeedCPUAdam, 16-bit parameters updated
    in place -- read as fp32, stepped with fp32 math and rounded to nearest even once per step.
    The gradient may be fp32, bf16 or fp16.

    Args:
        model_params: Parameters, ``(name, parameter)`` pairs or param groups.
        lr: Learning rate.
        bias_correction: Divide the moments by ``1 - beta**step``.
        betas: Decay rates of the first and second moments.
        eps: Added to the denominator.
        weight_decay: Weight decay coefficient.
        amsgrad: Must be False (DeepSpeedCPUAdam does not support it either).
        adamw_mode: Decoupled weight decay (the default) or L2 on the gradient.
        fp32_optimizer_states: fp32 moments (the default); False keeps them in the parameter's
            dtype when it is 16-bit (bf16 for an fp32 parameter), halving their memory.
        num_threads: Threads of the kernel (``None``: its default).

    Raises:
        ConfigError: A parameter the kernel cannot update (another device, fp64, not
            contiguous), or a bad hyperparameter.
    """

    def __init__(
        self,
        model_params: ParamsT,
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        adamw_mode: bool = True,
        fp32_optimizer_states: bool = True,
        *,
        num_threads: int | None = None,
    ) -> None:
        super().__init__(
            model_params,
            lr=lr,
            bias_correction=bias_correction,
            betas=betas,
            eps=eps,
            adam_w_mode=adamw_mode,
            weight_decay=weight_decay,
            amsgrad=amsgrad,
            impl="cpu",
            fp32_optimizer_states=fp32_optimizer_states,
            num_threads=num_threads,
        )
        refused = [
            f"{tuple(p.shape)} {p.dtype} on {p.device}"
            + ("" if p.is_contiguous() else " (not contiguous)")
            for group in self.param_groups
            for p in group["params"]
            if not (p.device.type == "cpu" and p.dtype in CPU_KERNEL_MOMENTS and p.is_contiguous())
        ]
        if refused:
            raise ConfigError(
                "CPUAdam updates contiguous fp32, bf16 or fp16 CPU parameters only, got "
                f"{refused[:3]}; move them to the CPU (ZeRO optimizer offload keeps an fp32 CPU "
                "master copy), cast fp64 ones to fp32, or use Adam(impl='auto'), which updates "
                "any other tensor with foreach ops"
            )
