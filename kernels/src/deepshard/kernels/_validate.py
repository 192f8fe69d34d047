"""Argument checks shared by the compiled ops and their pure-torch twins.

The compiled kernels read raw data pointers, so every tensor is checked here first: a wrong
dtype, device, layout or size would otherwise be read out of bounds. Errors name the argument
and say what to pass instead.
"""

from __future__ import annotations

import math

import torch

__all__ = [
    "GRAD_DTYPES",
    "OUT_DTYPES",
    "PARAM_DTYPES",
    "STATE_DTYPES",
    "check_adam_args",
    "check_lion_args",
    "state_dtypes",
]

PARAM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
STATE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
OUT_DTYPES = (torch.bfloat16, torch.float16)


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
) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{op}: `{name}` must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype not in dtypes:
        raise TypeError(
            f"{op}: `{name}` must have dtype {_names(dtypes)}{context}, got {_name(tensor.dtype)}"
        )
    if tensor.device.type != "cpu":
        raise ValueError(f"{op}: `{name}` must be on the CPU, got device {tensor.device}")
    if not tensor.is_contiguous():
        raise ValueError(f"{op}: `{name}` must be contiguous; pass `{name}.contiguous()`")
    if numel is not None and tensor.numel() != numel:
        raise ValueError(
            f"{op}: `{name}` has {tensor.numel()} elements but `param` has {numel}; "
            "every buffer of one step must cover the same parameters"
        )


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
    _check_tensor(op, "param", param, PARAM_DTYPES, None)
    assert isinstance(param, torch.Tensor)
    numel = param.numel()
    _check_tensor(op, "grad", grad, GRAD_DTYPES, numel)
    state_dtype: torch.dtype | None = None
    for_param = f" for a {_name(param.dtype)} `param`"
    for name, moment in moments.items():
        _check_tensor(op, name, moment, state_dtypes(param.dtype), numel, for_param)
        assert isinstance(moment, torch.Tensor)
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
    if isinstance(step, bool) or not isinstance(step, int):
        raise TypeError(f"{op}: `step` must be an int, got {type(step).__name__}")
    if step < 1:
        raise ValueError(f"{op}: `step` counts from 1 (the first update), got {step}")
    _check_real(op, "lr", lr, 0.0, None)
    _check_real(op, "beta1", beta1, 0.0, 1.0)
    _check_real(op, "beta2", beta2, 0.0, 1.0)
    _check_real(op, "eps", eps, 0.0, None)
    _check_real(op, "weight_decay", weight_decay, 0.0, None)
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
