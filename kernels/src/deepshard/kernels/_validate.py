"""Argument checks shared by the compiled ops (CPU, CUDA, MPS) and their pure-torch twins.

The compiled kernels read raw data pointers, so every tensor is checked here first: a wrong
dtype, device, layout or size would otherwise be read out of bounds. Errors name the argument
and say what to pass instead. The one-tensor CPU steps and the multi-tensor fused step share
the tensor and scalar checks below.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

__all__ = [
    "FUSED_GRAD_DTYPES",
    "GRAD_DTYPES",
    "OUT_DTYPES",
    "PARAM_DTYPES",
    "STATE_DTYPES",
    "check_adam_args",
    "check_fused_adam_args",
    "check_lion_args",
    "state_dtypes",
]

PARAM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
STATE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
OUT_DTYPES = (torch.bfloat16, torch.float16)
FUSED_GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
"""Gradient dtypes of the multi-tensor fused Adam step (its parameters and moments are fp32)."""


def state_dtypes(param_dtype: torch.dtype) -> tuple[torch.dtype, ...]:
    """The moment dtypes the kernels take for a ``param_dtype`` parameter.

    float32, or 16 bits: the parameter's own dtype when it is 16-bit (DeepSpeedCPUAdam's
    ``fp32_optimizer_states=False``), bfloat16 for a float32 master copy. Mirrors
    ``step_types_supported`` in csrc/cpu/kernels.h.
    """
    if param_dtype == torch.float16:
        return (torch.float32, torch.float16)
    return (torch.float32, torch.bfloat16)


def _names(dtypes: tuple[torch.dtype, ...]) -> str:
    return ", ".join(str(d).removeprefix("torch.") for d in dtypes)


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _check_tensor(
    op: str,
    name: str,
    tensor: object,
    dtypes: tuple[torch.dtype, ...],
    numel: int | None,
    context: str = "",
    *,
    device: torch.device | None = None,
    param_name: str = "param",
) -> torch.Tensor:
    """Checks one buffer and returns it, typed; ``device`` is where it must be (``None``: CPU)."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{op}: `{name}` must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype not in dtypes:
        raise TypeError(
            f"{op}: `{name}` must have dtype {_names(dtypes)}{context}, got {_name(tensor.dtype)}"
        )
    if device is None and tensor.device.type != "cpu":
        raise ValueError(f"{op}: `{name}` must be on the CPU, got device {tensor.device}")
    if device is not None and tensor.device != device:
        raise ValueError(
            f"{op}: `{name}` is on {tensor.device} but `params[0]` is on {device}; every "
            "tensor of one call must be on the same device (call once per device)"
        )
    if not tensor.is_contiguous():
        raise ValueError(f"{op}: `{name}` must be contiguous; pass `{name}.contiguous()`")
    if numel is not None and tensor.numel() != numel:
        raise ValueError(
            f"{op}: `{name}` has {tensor.numel()} elements but `{param_name}` has {numel}; "
            "every buffer of one step must cover the same parameters"
        )
    return tensor


def _check_real(op: str, name: str, value: object, low: float, high: float | None) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{op}: `{name}` must be a float, got {type(value).__name__}")
    if not math.isfinite(value) or value < low or (high is not None and value >= high):
        bound = f"in [{low}, {high})" if high is not None else f">= {low}"
        raise ValueError(f"{op}: `{name}` must be finite and {bound}, got {value}")


def _check_threads(op: str, num_threads: object) -> None:
    if num_threads is None:
        return
    if isinstance(num_threads, bool) or not isinstance(num_threads, int):
        raise TypeError(f"{op}: `num_threads` must be an int or None, got {num_threads!r}")
    if num_threads < 1:
        raise ValueError(f"{op}: `num_threads` must be >= 1 (or None for torch.get_num_threads())")


def _check_buffers(
    op: str,
    param: object,
    grad: object,
    moments: dict[str, object],
    param_out: object,
) -> None:
    param = _check_tensor(op, "param", param, PARAM_DTYPES, None)
    numel = param.numel()
    _check_tensor(op, "grad", grad, GRAD_DTYPES, numel)
    state_dtype: torch.dtype | None = None
    for_param = f" for a {_name(param.dtype)} `param`"
    for name, moment in moments.items():
        moment = _check_tensor(op, name, moment, state_dtypes(param.dtype), numel, for_param)
        if state_dtype is not None and moment.dtype != state_dtype:
            raise TypeError(f"{op}: `exp_avg` and `{name}` must have the same dtype")
        state_dtype = moment.dtype
    if param_out is not None and param.dtype != torch.float32:
        raise TypeError(
            f"{op}: `param_out` receives a low-precision copy of a float32 `param`; a "
            f"{_name(param.dtype)} `param` is updated in place, so pass param_out=None"
        )
    if param_out is not None:
        _check_tensor(op, "param_out", param_out, OUT_DTYPES, numel)


def _check_adam_scalars(
    op: str, step: object, lr: object, beta1: object, beta2: object, eps: object, wd: object
) -> None:
    if isinstance(step, bool) or not isinstance(step, int):
        raise TypeError(f"{op}: `step` must be an int, got {type(step).__name__}")
    if step < 1:
        raise ValueError(f"{op}: `step` counts from 1 (the first update), got {step}")
    _check_real(op, "lr", lr, 0.0, None)
    _check_real(op, "beta1", beta1, 0.0, 1.0)
    _check_real(op, "beta2", beta2, 0.0, 1.0)
    _check_real(op, "eps", eps, 0.0, None)
    _check_real(op, "weight_decay", wd, 0.0, None)


def check_adam_args(
    param: object,
    grad: object,
    exp_avg: object,
    exp_avg_sq: object,
    param_out: object,
    *,
    step: object,
    lr: object,
    beta1: object,
    beta2: object,
    eps: object,
    weight_decay: object,
    num_threads: object,
) -> None:
    """Raises TypeError/ValueError, naming the argument, unless an Adam step can run on these."""
    op = "cpu_adam_step"
    moments = {"exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}
    _check_buffers(op, param, grad, moments, param_out)
    _check_adam_scalars(op, step, lr, beta1, beta2, eps, weight_decay)
    _check_threads(op, num_threads)


def check_lion_args(
    param: object,
    grad: object,
    exp_avg: object,
    param_out: object,
    *,
    lr: object,
    beta1: object,
    beta2: object,
    weight_decay: object,
    num_threads: object,
) -> None:
    """Raises TypeError/ValueError, naming the argument, unless a Lion step can run on these."""
    op = "cpu_lion_step"
    _check_buffers(op, param, grad, {"exp_avg": exp_avg}, param_out)
    _check_real(op, "lr", lr, 0.0, None)
    _check_real(op, "beta1", beta1, 0.0, 1.0)
    _check_real(op, "beta2", beta2, 0.0, 1.0)
    _check_real(op, "weight_decay", weight_decay, 0.0, None)
    _check_threads(op, num_threads)


def check_fused_adam_args(
    op: str,
    lists: tuple[Sequence[object], ...],
    *,
    step: object,
    lr: object,
    beta1: object,
    beta2: object,
    eps: object,
    weight_decay: object,
) -> None:
    """Raises TypeError/ValueError, naming the argument, unless a fused Adam step can run.

    Args:
        op: The op's name, for the messages.
        lists: ``(params, grads, exp_avgs, exp_avg_sqs)``: fp32 parameters and moments, fp32,
            bf16 or fp16 gradients, all contiguous and on the device of ``params[0]``.
        step: As `check_adam_args`.
        lr: As `check_adam_args`.
        beta1: As `check_adam_args`.
        beta2: As `check_adam_args`.
        eps: As `check_adam_args`.
        weight_decay: As `check_adam_args`.
    """
    _check_adam_scalars(op, step, lr, beta1, beta2, eps, weight_decay)
    names = ("params", "grads", "exp_avgs", "exp_avg_sqs")
    if len({len(tensors) for tensors in lists}) != 1:
        counts = ", ".join(f"{len(t)} {n}" for n, t in zip(names, lists, strict=True))
        raise ValueError(f"{op}: got {counts}; pass exactly one of each per parameter")
    if not lists[0]:
        return
    first = lists[0][0]
    if not isinstance(first, torch.Tensor):
        raise TypeError(f"{op}: `params[0]` must be a torch.Tensor, got {type(first).__name__}")
    for i, group in enumerate(zip(*lists, strict=True)):
        param = _check_tensor(
            op, f"params[{i}]", group[0], (torch.float32,), None, device=first.device
        )
        for name, tensor in zip(names[1:], group[1:], strict=True):
            dtypes = FUSED_GRAD_DTYPES if name == "grads" else (torch.float32,)
            _check_tensor(
                op, f"{name}[{i}]", tensor, dtypes, param.numel(), device=first.device,
                param_name=f"params[{i}]",
            )  # fmt: skip
