"""Lion (EvoLved Sign Momentum), with the CPU kernel for fp32, bf16 and fp16 CPU parameters.

With ``m`` the momentum (``exp_avg``) and ``g`` the gradient, one step is::

    c = beta1*m + (1-beta1)*g
    p = p * (1 - lr*wd) - lr * sign(c)
    m = beta2*m + (1-beta2)*g

Every coordinate moves by exactly ``lr`` (plus the decoupled decay), so Lion wants a learning
rate 3-10x smaller than AdamW's. Chen et al., "Symbolic Discovery of Optimization Algorithms".
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from deepshard.interface.errors import ConfigError
from deepshard.optimizers import _kernels
from deepshard.optimizers._adam_step import cpu_kernel_takes
from deepshard.optimizers._checks import (
    check_betas,
    check_choice,
    check_gradient,
    check_hyperparameters,
)
from deepshard.optimizers._state import moment_dtype, restore_saved_dtypes
from deepshard.optimizers.adam import ParamsT

__all__ = ["Lion"]

LION_IMPLS = ("auto", "cpu", "foreach")


class Lion(torch.optim.Optimizer):
    """The Lion optimizer (DeepSpeed's FusedLion / DeepSpeedCPULion arguments).

    Args:
        params: Parameters, ``(name, parameter)`` pairs or param groups; a group's own ``lr``,
            ``betas`` and ``weight_decay`` win.
        lr: Learning rate.
        betas: ``beta1`` (interpolation for the update direction) and ``beta2`` (momentum decay).
        weight_decay: Decoupled weight decay coefficient.
        impl: ``"auto"`` (CPU kernel for contiguous fp32/bf16/fp16 CPU parameters, foreach
            otherwise), ``"cpu"`` or ``"foreach"``. The kernel updates 16-bit parameters in
            place with fp32 math, rounding once per step.
        fp32_optimizer_states: fp32 momentum (default); False keeps it in 16 bits (the
            parameter's dtype when 16-bit, else bf16).
        num_threads: Threads of the CPU kernel (``None``: its default).

    Raises:
        ConfigError: A hyperparameter out of range or an unknown ``impl``.
    """

    zero_safe = True
    """The update is element-wise, so ZeRO may step flat partitions of it."""

    def __init__(
        self,
        params: ParamsT,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        weight_decay: float = 0.0,
        *,
        impl: str = "auto",
        fp32_optimizer_states: bool = True,
        num_threads: int | None = None,
    ) -> None:
        self.impl = check_choice("impl", impl, LION_IMPLS)
        self.fp32_optimizer_states = bool(fp32_optimizer_states)
        self.num_threads = num_threads
        super().__init__(params, {"lr": lr, "betas": betas, "weight_decay": weight_decay})

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Adds a group, filling unset values from the defaults and checking them."""
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        group["betas"] = check_betas(group["betas"])
        check_hyperparameters(lr=group["lr"], weight_decay=group["weight_decay"])

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads a state dict, keeping the dtype the momentum was saved in."""
        super().load_state_dict(state_dict)
        restore_saved_dtypes(self, state_dict)

    def _momentum(self, param: torch.Tensor) -> torch.Tensor:
        state = self.state[param]
        if "exp_avg" not in state:
            dtype = moment_dtype(param.dtype, self.fp32_optimizer_states)
            state["exp_avg"] = torch.zeros(param.shape, dtype=dtype, device=param.device)
        exp_avg: torch.Tensor = state["exp_avg"]
        return exp_avg

    def _use_kernel(self, param: torch.Tensor, exp_avg: torch.Tensor) -> bool:
        takes = cpu_kernel_takes(param, exp_avg)
        if self.impl == "cpu" and not takes:
            layout = "" if param.is_contiguous() else "non-contiguous "
            raise ConfigError(
                "Lion with impl='cpu' updates contiguous fp32, bf16 or fp16 CPU parameters with "
                "fp32 momentum or 16-bit momentum (the parameter's dtype; bf16 for fp32), got a "
                f"{layout}{param.dtype} parameter on {param.device} with {exp_avg.dtype} "
                "momentum; move the parameters to the CPU or use impl='auto'"
            )
        return takes and self.impl != "foreach"

    def _step_group(self, group: dict[str, Any]) -> None:
        beta1, beta2 = group["betas"]
        hyper = {
            "lr": float(group["lr"]),
            "beta1": float(beta1),
            "beta2": float(beta2),
            "weight_decay": float(group["weight_decay"]),
        }
        buckets: dict[torch.device, list[list[torch.Tensor]]] = {}
        for param in group["params"]:
            grad = param.grad
            if grad is None:
                continue
            check_gradient(param, grad, "Lion")
            exp_avg = self._momentum(param)
            if self._use_kernel(param, exp_avg):
                if grad.dtype not in (torch.float32, torch.bfloat16, torch.float16):
                    grad = grad.float()
                kernel_grad = grad.contiguous()
                _kernels.cpu_lion_step(
                    param, kernel_grad, exp_avg, num_threads=self.num_threads, **hyper
                )
                continue
            lists = buckets.setdefault(param.device, [[], [], []])
            for target, tensor in zip(lists, (param, grad, exp_avg), strict=True):
                target.append(tensor)
        for params, grads, exp_avgs in buckets.values():
            _kernels.foreach_lion_step(params, grads, exp_avgs, **hyper)

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
            self._step_group(group)
        return loss
