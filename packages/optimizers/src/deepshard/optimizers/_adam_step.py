"""The Adam step driver shared by `Adam`, `CPUAdam` and Muon's auxiliary Adam.

Each parameter is routed to one implementation:

* ``"cpu"``: the SIMD kernel of ``deepshard.kernels``, one call per tensor. It takes a
  contiguous fp32, bf16 or fp16 CPU parameter (a 16-bit one is updated in place with fp32 math,
  as DeepSpeedCPUAdam does), an fp32/bf16/fp16 gradient, and fp32 moments or 16-bit ones: the
  parameter's own dtype, bf16 for an fp32 parameter (`CPU_KERNEL_MOMENTS`).
* ``"fused"``: the multi-tensor kernel (CUDA), one call per device and step count; on
  other devices ``deepshard.kernels`` runs its ``torch._foreach`` twin.
* ``"foreach"``: the kernels package's dtype-general ``torch._foreach`` twin, any device
  and dtype.

``"auto"`` picks ``cpu`` where the kernel takes the parameter, ``fused`` for CUDA tensors and
``foreach`` otherwise (fp64, non-contiguous or other devices), so every model trains with
``impl="auto"``.
"""

from __future__ import annotations

from collections.abc import MutableMapping
from dataclasses import dataclass
from typing import Any

import torch

from deepshard.interface.errors import ConfigError
from deepshard.optimizers import _kernels
from deepshard.optimizers._checks import check_gradient
from deepshard.optimizers._state import moment_dtype

__all__ = [
    "ADAM_IMPLS",
    "CPU_KERNEL_MOMENTS",
    "AdamSettings",
    "adam_step",
    "cpu_kernel_takes",
    "kernel_takes",
    "resolve_impl",
]

ADAM_IMPLS = ("auto", "cpu", "fused", "foreach")
_KERNEL_GRADS = (torch.float32, torch.bfloat16, torch.float16)
CPU_KERNEL_MOMENTS = {
    torch.float32: (torch.float32, torch.bfloat16),
    torch.bfloat16: (torch.float32, torch.bfloat16),
    torch.float16: (torch.float32, torch.float16),
}
"""Parameter dtype -> the moment dtypes the CPU kernels (Adam and Lion) take with it."""


@dataclass(frozen=True)
class AdamSettings:
    """The hyperparameters of one Adam step (one param group)."""

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    adamw_mode: bool
    bias_correction: bool

    @classmethod
    def from_group(cls, group: dict[str, Any], *, adamw_mode: bool) -> AdamSettings:
        """Reads a param group holding ``lr``, ``betas``, ``eps`` and ``weight_decay``."""
        beta1, beta2 = group["betas"]
        return cls(
            lr=float(group["lr"]),
            beta1=float(beta1),
            beta2=float(beta2),
            eps=float(group["eps"]),
            weight_decay=float(group["weight_decay"]),
            adamw_mode=bool(group.get("adam_w_mode", adamw_mode)),
            bias_correction=bool(group.get("bias_correction", True)),
        )


def cpu_kernel_takes(param: torch.Tensor, moment: torch.Tensor) -> bool:
    """Whether the CPU kernels can update ``param`` with moments of ``moment``'s dtype."""
    return (
        param.device.type == "cpu"
        and param.is_contiguous()
        and moment.dtype in CPU_KERNEL_MOMENTS.get(param.dtype, ())
    )


def kernel_takes(impl: str, param: torch.Tensor, moment: torch.Tensor) -> bool:
    """Whether the ``"cpu"`` or ``"fused"`` kernel can update ``param`` with this moment dtype."""
    if impl == "cpu":
        return cpu_kernel_takes(param, moment)
    return param.dtype == moment.dtype == torch.float32 and param.is_contiguous()


def resolve_impl(impl: str, param: torch.Tensor, moment: torch.Tensor, owner: str) -> str:
    """The implementation that updates ``param`` (whose moments have ``moment``'s dtype).

    Raises:
        ConfigError: ``impl="cpu"`` or ``"fused"`` for a parameter that kernel cannot update.
    """
    if impl == "auto":
        if kernel_takes("cpu", param, moment):
            return "cpu"
        if param.device.type == "cuda" and kernel_takes("fused", param, moment):
            return "fused"
        return "foreach"
    if impl == "cpu" and not kernel_takes(impl, param, moment):
        raise ConfigError(
            f"{owner} with impl='cpu' updates contiguous fp32, bf16 or fp16 CPU parameters with "
            "fp32 moments or 16-bit ones (the parameter's dtype; bf16 for fp32), got a "
            f"{_described(param)} with {moment.dtype} moments; move the parameters to the "
            "CPU (contiguous, fp32/bf16/fp16) or use impl='auto', which updates any other "
            "tensor with foreach ops"
        )
    if impl == "fused" and not kernel_takes(impl, param, moment):
        raise ConfigError(
            f"{owner} with impl='fused' updates contiguous fp32 parameters with fp32 moments, "
            f"got a {_described(param)} with {moment.dtype} moments; keep an fp32 master copy "
            "(ZeRO optimizer offload does) or use impl='auto'"
        )
    return impl


def _described(param: torch.Tensor) -> str:
    layout = "" if param.is_contiguous() else "non-contiguous "
    return f"{layout}{param.dtype} parameter on {param.device}"


def _moments(
    param: torch.Tensor, state: dict[str, Any], fp32_optimizer_states: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    if "exp_avg" not in state:
        dtype = moment_dtype(param.dtype, fp32_optimizer_states)
        state["step"] = 0
        state["exp_avg"] = torch.zeros(param.shape, dtype=dtype, device=param.device)
        state["exp_avg_sq"] = torch.zeros(param.shape, dtype=dtype, device=param.device)
    return state["exp_avg"], state["exp_avg_sq"]


def _kernel_grad(grad: torch.Tensor) -> torch.Tensor:
    return (grad if grad.dtype in _KERNEL_GRADS else grad.float()).contiguous()


def _cpu_step(
    param: torch.Tensor,
    grad: torch.Tensor,
    state: dict[str, Any],
    s: AdamSettings,
    threads: int | None,
) -> None:
    _kernels.cpu_adam_step(
        param,
        _kernel_grad(grad),
        state["exp_avg"],
        state["exp_avg_sq"],
        step=state["step"],
        lr=s.lr,
        beta1=s.beta1,
        beta2=s.beta2,
        eps=s.eps,
        weight_decay=s.weight_decay,
        adamw_mode=s.adamw_mode,
        bias_correction=s.bias_correction,
        num_threads=threads,
    )


def run_bucket(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    step: int,
    s: AdamSettings,
    *,
    fused: bool,
) -> None:
    """One multi-tensor Adam step with the fused kernel or the foreach update."""
    function = _kernels.fused_adam_step if fused else _kernels.foreach_adam_step
    function(
        params,
        grads,
        exp_avgs,
        exp_avg_sqs,
        step=step,
        lr=s.lr,
        beta1=s.beta1,
        beta2=s.beta2,
        eps=s.eps,
        weight_decay=s.weight_decay,
        adamw_mode=s.adamw_mode,
        bias_correction=s.bias_correction,
    )


def adam_step(
    params: list[torch.Tensor],
    state: MutableMapping[torch.Tensor, Any],
    settings: AdamSettings,
    *,
    impl: str,
    fp32_optimizer_states: bool,
    num_threads: int | None,
    owner: str,
) -> None:
    """Applies one Adam step to every parameter of ``params`` that has a gradient.

    Args:
        params: The parameters of one group.
        state: The optimizer's per-parameter state (``step``, ``exp_avg``, ``exp_avg_sq``).
        settings: The group's hyperparameters.
        impl: ``"auto"``, ``"cpu"``, ``"fused"`` or ``"foreach"``.
        fp32_optimizer_states: Whether new moments are fp32 (else 16-bit).
        num_threads: Threads for the CPU kernel (``None``: its default).
        owner: The optimizer's name, for error messages.
    """
    buckets: dict[tuple[str, torch.device, int], list[list[torch.Tensor]]] = {}
    for param in params:
        grad = param.grad
        if grad is None:
            continue
        check_gradient(param, grad, owner)
        param_state = state[param]
        exp_avg, exp_avg_sq = _moments(param, param_state, fp32_optimizer_states)
        chosen = resolve_impl(impl, param, exp_avg, owner)
        # int() also reads the tensor step of a state dict saved by torch.optim.Adam.
        param_state["step"] = int(param_state["step"]) + 1
        if chosen == "fused":
            grad = _kernel_grad(grad)
        elif chosen == "cpu":
            _cpu_step(param, grad, param_state, settings, num_threads)
            continue
        key = (chosen, param.device, param_state["step"])
        lists = buckets.setdefault(key, [[], [], [], []])
        for target, tensor in zip(lists, (param, grad, exp_avg, exp_avg_sq), strict=True):
            target.append(tensor)
    for (chosen, _, step), (ps, gs, ms, vs) in buckets.items():
        run_bucket(ps, gs, ms, vs, step, settings, fused=chosen == "fused")
