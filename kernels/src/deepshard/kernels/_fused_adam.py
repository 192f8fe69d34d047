"""Multi-tensor fused Adam/AdamW over lists of tensors, updated in place.

Per element of every parameter, in fp32 arithmetic (bf16/fp16 gradients are widened first), with
``bc1 = 1 - beta1**step`` and ``bc2 = 1 - beta2**step`` (both 1 without bias correction)::

    adamw_mode:  p *= 1 - lr * weight_decay      otherwise:  g += weight_decay * p
    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * g * g
    p -= (lr / bc1) * m / (sqrt(v) / sqrt(bc2) + eps)

which is ``torch.optim.AdamW`` (``adamw_mode=True``) or ``torch.optim.Adam`` with L2 decay.

On CUDA tensors the compiled ``deepshard.kernels._cuda`` module updates all tensors with a few
launches (each block takes one 64Ki-element chunk of one tensor; see
``csrc/cuda/fused_adam.cu``). Everywhere else -- CPU tensors, or CUDA tensors when the module
was not built or was built for other GPUs -- ``reference_fused_adam_step`` does the same with
``torch._foreach_*`` ops in the order ``torch.optim.Adam(foreach=True)`` uses them, so it
matches torch bit for bit and the kernel to rounding (the kernel writes the first moment as
``b1*m + (1-b1)*g`` where torch uses ``lerp``, and contracts to FMA). The compiled module is
imported on the first CUDA call, never at import time; when it cannot serve CUDA tensors, one
warning says why.

The op is registered as ``deepshard::fused_adam_step`` through ``torch.library`` (with a fake
implementation), so it can sit inside ``torch.compile``-d code.
"""

from __future__ import annotations

import functools
import re
import warnings
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from deepshard.kernels._constants import bias_corrections
from deepshard.kernels._extension import CUDA_EXTENSION
from deepshard.kernels._foreach import foreach_adam_step
from deepshard.kernels._validate import check_fused_adam_args

__all__ = ["fused_adam_status", "fused_adam_step", "reference_fused_adam_step"]

# Gradient dtypes the kernel reads (`FUSED_GRAD_DTYPES`), with the codes of
# deepshard::cuda::GradType.
_GRAD_TYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


class _AdamHyper(NamedTuple):
    """The scalar arguments of one step, as the op receives them."""

    step: int
    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    adamw_mode: bool
    bias_correction: bool


def fused_adam_step(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    *,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    adamw_mode: bool = True,
    bias_correction: bool = True,
) -> None:
    """Applies one Adam/AdamW step to every parameter, in place.

    Uses the fused CUDA kernel for CUDA tensors when it is available, and
    `reference_fused_adam_step` otherwise (with one warning if CUDA tensors had to fall back).

    Args:
        params: fp32 parameters, contiguous, all on one device; updated in place.
        grads: One gradient per parameter (fp32, bf16 or fp16), same number of elements.
        exp_avgs: fp32 first moments, one per parameter; updated in place.
        exp_avg_sqs: fp32 second moments, one per parameter; updated in place.
        step: The step number, counted from 1 (this step included).
        lr: Learning rate.
        beta1: First-moment decay, in [0, 1).
        beta2: Second-moment decay, in [0, 1).
        eps: Added to the denominator.
        weight_decay: Decoupled decay (``adamw_mode``) or L2 coefficient added to the gradient.
        adamw_mode: True for AdamW's decoupled decay, False for Adam's L2 decay.
        bias_correction: Whether to divide the moments by ``1 - beta**step``.

    Raises:
        TypeError: An argument is not a tensor, or a tensor has an unsupported dtype.
        ValueError: The lists differ in length, or a tensor's size, device or layout does not
            fit, or a hyperparameter is out of range.
    """
    hyper = _AdamHyper(step, lr, beta1, beta2, eps, weight_decay, adamw_mode, bias_correction)
    _check("fused_adam_step", (params, grads, exp_avgs, exp_avg_sqs), hyper)
    if params:
        with torch.no_grad():
            _fused_adam_op(list(params), list(grads), list(exp_avgs), list(exp_avg_sqs), *hyper)


def reference_fused_adam_step(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    *,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    adamw_mode: bool = True,
    bias_correction: bool = True,
) -> None:
    """The pure-torch twin of `fused_adam_step` (``torch._foreach_*`` ops), on any device.

    Takes the same arguments, updates the same tensors and raises the same errors as
    `fused_adam_step`; it is what `fused_adam_step` runs on CPU tensors.

    Raises:
        TypeError: As `fused_adam_step`.
        ValueError: As `fused_adam_step`.
    """
    hyper = _AdamHyper(step, lr, beta1, beta2, eps, weight_decay, adamw_mode, bias_correction)
    _check("reference_fused_adam_step", (params, grads, exp_avgs, exp_avg_sqs), hyper)
    if params:
        with torch.no_grad():
            _foreach_adam(list(params), list(grads), list(exp_avgs), list(exp_avg_sqs), hyper)


def fused_adam_status() -> tuple[bool, str]:
    """Says whether the CUDA kernel is compiled and loadable, loading it if need be.

    Returns:
        ``(True, description)`` with the CUDA architectures it was built for and the runtime,
        driver and devices it sees; or ``(False, reason)`` saying why it is missing and how to
        get it.
    """
    module = CUDA_EXTENSION.load()
    if module is None:
        return False, CUDA_EXTENSION.failure_with_hint()
    return True, (
        f"multi-tensor fused Adam built for CUDA architectures {module.cuda_architectures}; "
        f"{module.runtime_summary()}"
    )


@torch.library.custom_op(
    "deepshard::fused_adam_step", mutates_args=("params", "exp_avgs", "exp_avg_sqs")
)
def _fused_adam_op(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    adamw_mode: bool,
    bias_correction: bool,
) -> None:
    hyper = _AdamHyper(step, lr, beta1, beta2, eps, weight_decay, adamw_mode, bias_correction)
    if params and params[0].device.type == "cuda":
        module = _cuda_module_for(params[0].device)
        if module is not None:
            _launch_cuda(module, params, grads, exp_avgs, exp_avg_sqs, hyper)
            return
    _foreach_adam(params, grads, exp_avgs, exp_avg_sqs, hyper)


@_fused_adam_op.register_fake
def _fused_adam_fake(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    adamw_mode: bool,
    bias_correction: bool,
) -> None:
    # The op only mutates its inputs in place: no outputs, nothing to allocate.
    return None


def _check(op: str, lists: tuple[Sequence[torch.Tensor], ...], hyper: _AdamHyper) -> None:
    """The shared argument checks of `_validate`, for this op's scalars."""
    check_fused_adam_args(
        op, lists, step=hyper.step, lr=hyper.lr, beta1=hyper.beta1, beta2=hyper.beta2,
        eps=hyper.eps, weight_decay=hyper.weight_decay,
    )  # fmt: skip


def _foreach_adam(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    hyper: _AdamHyper,
) -> None:
    """The twin: the kernels' dtype-general ``torch._foreach`` Adam."""
    foreach_adam_step(
        params, grads, exp_avgs, exp_avg_sqs, step=hyper.step, lr=hyper.lr, beta1=hyper.beta1,
        beta2=hyper.beta2, eps=hyper.eps, weight_decay=hyper.weight_decay,
        adamw_mode=hyper.adamw_mode, bias_correction=hyper.bias_correction,
    )  # fmt: skip


def _launch_cuda(
    module: Any,
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    hyper: _AdamHyper,
) -> None:
    """Enqueues the kernel on the caller's current stream, one launch group per grad dtype."""
    device = params[0].device
    stream = torch.cuda.current_stream(device).cuda_stream
    bias_correction1, bias_correction2_sqrt = bias_corrections(
        hyper.step, hyper.beta1, hyper.beta2, hyper.bias_correction
    )
    for dtype in dict.fromkeys(g.dtype for g in grads):
        group = [i for i, g in enumerate(grads) if g.dtype == dtype]
        module.fused_adam_step(
            params=[params[i].data_ptr() for i in group],
            grads=[grads[i].data_ptr() for i in group],
            exp_avgs=[exp_avgs[i].data_ptr() for i in group],
            exp_avg_sqs=[exp_avg_sqs[i].data_ptr() for i in group],
            numels=[params[i].numel() for i in group],
            grad_type=_GRAD_TYPE_CODES[dtype],
            lr=hyper.lr,
            beta1=hyper.beta1,
            beta2=hyper.beta2,
            eps=hyper.eps,
            weight_decay=hyper.weight_decay,
            bias_correction1=bias_correction1,
            bias_correction2_sqrt=bias_correction2_sqrt,
            adamw_mode=hyper.adamw_mode,
            device=device.index,
            stream=stream,
        )


def _cuda_module_for(device: torch.device) -> Any:
    """The compiled module if it can run on ``device``; else None, after one warning."""
    module = CUDA_EXTENSION.load()
    reason = CUDA_EXTENSION.failure_with_hint()
    if module is not None:
        major, minor = torch.cuda.get_device_capability(device)
        if _architectures_cover(module.cuda_architectures, 10 * major + minor):
            return module
        reason = (
            f"deepshard.kernels._cuda was built for CUDA architectures "
            f"{module.cuda_architectures}, which cannot run on {device} (sm_{major}{minor}); "
            f"reinstall deepshard-kernels with DEEPSHARD_CUDA_ARCHS={major}{minor}"
        )
    _warn_kernel_unavailable(reason)
    return None


def _architectures_cover(architectures: str, capability: int) -> bool:
    """Whether a build for ``architectures`` ("80,90", CMake spelling) runs on ``capability``.

    Machine code for sm_XY runs on sm_XZ with Z >= Y; PTX (any entry not marked ``-real``) is
    compiled by the driver for any later GPU; ``90a``-style entries run on their own GPU only,
    ``100f``-style ones on their family (same major version, no PTX for later families).
    A spelling this does not know ("native", "all") is trusted: a failed launch still raises.
    """
    parsed = [
        re.fullmatch(r"\s*(\d+)([af]?)(-real|-virtual)?\s*", entry)
        for entry in architectures.split(",")
    ]
    entries = [found for found in parsed if found is not None]
    if not entries:
        return True
    for found in entries:
        arch, specific, kind = int(found.group(1)), found.group(2), found.group(3)
        same_family = arch // 10 == capability // 10 and arch <= capability
        if specific == "a":
            runs = arch == capability
        elif specific == "f":
            runs = same_family
        else:
            runs = (kind != "-virtual" and same_family) or (kind != "-real" and arch <= capability)
        if runs:
            return True
    return False


@functools.cache
def _warn_kernel_unavailable(reason: str) -> None:
    """Warns once per process (per reason) that CUDA tensors use the torch twin."""
    warnings.warn(
        f"fused_adam_step: the CUDA kernel is unavailable, using the torch._foreach twin "
        f"instead: {reason}",
        RuntimeWarning,
        stacklevel=2,
    )
