"""The CPU Adam/AdamW and Lion steps as torch.library custom ops.

``cpu_adam_step``/``cpu_lion_step`` update flat CPU tensors in place with one pass over memory in
the compiled extension (csrc/cpu), on the best SIMD path of this CPU and several threads. They are
registered as ``deepshard::cpu_adam_step``/``deepshard::cpu_lion_step`` with fake (meta)
implementations, so ``torch.compile`` traces through them. Eager calls skip the dispatcher (a
custom-op call costs ~30 us of Python, more than the step itself on a small tensor) and run the
same implementation directly, bumping the version counters of the tensors they mutate as the
dispatcher would. Without the extension the pure-torch twins run instead (see `_extension`).
"""

import torch

from deepshard.kernels import _extension
from deepshard.kernels._constants import bias_corrections
from deepshard.kernels._reference import run_reference_adam, run_reference_lion
from deepshard.kernels._validate import check_adam_args, check_lion_args

__all__ = ["cpu_adam_step", "cpu_lion_step"]

# The dtype codes of csrc/cpu/kernels.h (`enum class DType`).
_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_NONE_CODE = 3


def _out_pointer(param_out: torch.Tensor | None) -> tuple[int, int]:
    if param_out is None:
        return 0, _NONE_CODE
    return param_out.data_ptr(), _DTYPE_CODES[param_out.dtype]


def _bump_versions(*mutated: torch.Tensor | None) -> None:
    """Marks in-place writes for autograd, as the dispatcher does for a mutating custom op."""
    torch.autograd.graph.increment_version([t for t in mutated if t is not None])


def _threads(num_threads: int | None) -> int:
    return torch.get_num_threads() if num_threads is None else num_threads


def _adam_impl(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    param_out: torch.Tensor | None,
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
    check_adam_args(
        param, grad, exp_avg, exp_avg_sq, param_out, step=step, lr=lr, beta1=beta1,
        beta2=beta2, eps=eps, weight_decay=weight_decay, num_threads=num_threads,
    )  # fmt: skip
    extension = _extension.CPU_EXTENSION.get()
    if extension is None:
        run_reference_adam(
            param, grad, exp_avg, exp_avg_sq, param_out, step=step, lr=lr, beta1=beta1,
            beta2=beta2, eps=eps, weight_decay=weight_decay, adamw_mode=adamw_mode,
            bias_correction=bias_correction,
        )  # fmt: skip
        return
    bc1, bc2_sqrt = bias_corrections(step, beta1, beta2, bias_correction)
    out_ptr, out_code = _out_pointer(param_out)
    extension.adam_step(
        param.data_ptr(), _DTYPE_CODES[param.dtype], grad.data_ptr(), _DTYPE_CODES[grad.dtype],
        exp_avg.data_ptr(), exp_avg_sq.data_ptr(), _DTYPE_CODES[exp_avg.dtype], out_ptr,
        out_code, param.numel(), lr, beta1, beta2, eps, weight_decay, bc1, bc2_sqrt, adamw_mode,
        _threads(num_threads),
    )  # fmt: skip


_adam_op = torch.library.custom_op(
    "deepshard::cpu_adam_step",
    _adam_impl,
    mutates_args=("param", "exp_avg", "exp_avg_sq", "param_out"),
)


@_adam_op.register_fake
def _adam_fake(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    param_out: torch.Tensor | None,
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
    return None


def _lion_impl(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    param_out: torch.Tensor | None,
    lr: float,
    beta1: float,
    beta2: float,
    weight_decay: float,
    num_threads: int | None,
) -> None:
    check_lion_args(
        param, grad, exp_avg, param_out, lr=lr, beta1=beta1, beta2=beta2,
        weight_decay=weight_decay, num_threads=num_threads,
    )  # fmt: skip
    extension = _extension.CPU_EXTENSION.get()
    if extension is None:
        run_reference_lion(
            param, grad, exp_avg, param_out, lr=lr, beta1=beta1, beta2=beta2,
            weight_decay=weight_decay,
        )  # fmt: skip
        return
    out_ptr, out_code = _out_pointer(param_out)
    extension.lion_step(
        param.data_ptr(), _DTYPE_CODES[param.dtype], grad.data_ptr(), _DTYPE_CODES[grad.dtype],
        exp_avg.data_ptr(), _DTYPE_CODES[exp_avg.dtype], out_ptr, out_code, param.numel(), lr,
        beta1, beta2, weight_decay, _threads(num_threads),
    )  # fmt: skip


_lion_op = torch.library.custom_op(
    "deepshard::cpu_lion_step", _lion_impl, mutates_args=("param", "exp_avg", "param_out")
)


@_lion_op.register_fake
def _lion_fake(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    param_out: torch.Tensor | None,
    lr: float,
    beta1: float,
    beta2: float,
    weight_decay: float,
    num_threads: int | None,
) -> None:
    return None


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
    adamw_mode: bool = True,
    bias_correction: bool = True,
    param_out: torch.Tensor | None = None,
    num_threads: int | None = None,
) -> None:
    """One Adam (``adamw_mode=False``) or AdamW step on flat CPU tensors, in place.

    Follows torch.optim.AdamW/Adam: AdamW first scales ``param`` by ``1 - lr * weight_decay``,
    Adam adds ``weight_decay * param`` to the gradient; then
    ``m = beta1 m + (1 - beta1) g``, ``v = beta2 v + (1 - beta2) g^2`` and
    ``param -= lr / bc1 * m / (sqrt(v) / sqrt(bc2) + eps)`` with ``bc_i = 1 - beta_i^step``
    (both 1 when ``bias_correction`` is off). The math is float32 whatever the dtypes: 16-bit
    parameters, gradients and moments are widened on load, and 16-bit parameters and moments are
    stored back rounded to nearest even (as ``.to(dtype)`` rounds), once per step.

    Args:
        param: Parameters, float32, bfloat16 or float16, updated in place.
        grad: Gradient, float32, bfloat16 or float16 (read as float32).
        exp_avg: First moment, updated in place: float32, or 16 bits -- bfloat16 for a float32
            or bfloat16 ``param``, float16 for a float16 one.
        exp_avg_sq: Second moment, same dtype as ``exp_avg``, updated in place.
        step: Number of this step, from 1.
        lr: Learning rate.
        beta1: First-moment decay, in [0, 1).
        beta2: Second-moment decay, in [0, 1).
        eps: Added to the bias-corrected ``sqrt(v)``.
        weight_decay: Decoupled (AdamW) or L2 (Adam) coefficient.
        adamw_mode: Decoupled weight decay (AdamW) when true, L2 (Adam) when false.
        bias_correction: Divide the moments by ``1 - beta^step``.
        param_out: Optional bfloat16/float16 tensor that receives the updated float32
            parameters (rounded to nearest even), e.g. the low-precision copy sent back to the
            device; only with a float32 ``param`` (a 16-bit one is its own copy).
        num_threads: Threads to split the step over; ``None`` means ``torch.get_num_threads()``.
            Small tensors run on the calling thread.

    Raises:
        TypeError: A tensor has the wrong type or dtype, or a scalar the wrong type.
        ValueError: A tensor is not a contiguous CPU tensor of ``param``'s size, or a scalar is
            out of range.
    """
    args = (
        param, grad, exp_avg, exp_avg_sq, param_out, step, lr, beta1, beta2, eps, weight_decay,
        adamw_mode, bias_correction, num_threads,
    )  # fmt: skip
    if torch.compiler.is_compiling():
        _adam_op(*args)
        return
    _adam_impl(*args)
    _bump_versions(param, exp_avg, exp_avg_sq, param_out)


def cpu_lion_step(
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
    """One Lion step on flat CPU tensors, in place (Chen et al. 2023, as in DeepSpeed).

    ``c = beta1 m + (1 - beta1) g``; ``param = param (1 - lr wd) - lr sign(c)``;
    ``m = beta2 m + (1 - beta2) g`` (``sign(0) = 0``, as torch.sign).

    Computed in float32 like `cpu_adam_step`, with the same dtypes allowed.

    Args:
        param: Parameters, float32, bfloat16 or float16, updated in place.
        grad: Gradient, float32, bfloat16 or float16.
        exp_avg: Momentum, float32 or 16 bits (as `cpu_adam_step`'s moments), updated in place.
        lr: Learning rate.
        beta1: Interpolation weight of the update direction, in [0, 1).
        beta2: Momentum decay, in [0, 1).
        weight_decay: Decoupled weight decay coefficient.
        param_out: Optional bfloat16/float16 tensor that receives the updated parameters
            (float32 ``param`` only).
        num_threads: Threads to split the step over; ``None`` means ``torch.get_num_threads()``.

    Raises:
        TypeError: A tensor has the wrong type or dtype, or a scalar the wrong type.
        ValueError: A tensor is not a contiguous CPU tensor of ``param``'s size, or a scalar is
            out of range.
    """
    args = (param, grad, exp_avg, param_out, lr, beta1, beta2, weight_decay, num_threads)
    if torch.compiler.is_compiling():
        _lion_op(*args)
        return
    _lion_impl(*args)
    _bump_versions(param, exp_avg, param_out)
