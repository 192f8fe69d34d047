"""`fused_weighted_sum`: the combine step of a mixture-of-experts layer, in one pass.

After the experts ran, their outputs are ``N >= T·K`` rows in expert-sorted order (plus any
padding rows the grouped GEMM needed). Token ``t``'s ``k``-th choice sits at row
``index[t, k]`` (the inverse of the sort permutation), and the layer's output is

    out[t] = sum_k scores[t, k] * rows[index[t, k]]

accumulated in fp32 and written in the rows' dtype. Done naively this is a gather to a
``[T, K, H]`` copy, a multiply and a reduction (three passes and a ``T·K·H`` temporary); the op
reads each needed row once and writes each output row once.

The backward is the same gather read the other way round:

    grad_rows[index[t, k]] += scores[t, k] * grad_out[t]          (rows' dtype)
    grad_scores[t, k]       = <rows[index[t, k]], grad_out[t]>    (fp32 dot product)

Rows no token refers to (padding) get a zero gradient. Both directions are ``torch.library``
custom ops (``deepshard::fused_weighted_sum`` and ``deepshard::fused_weighted_sum_backward``)
with fake implementations, so they trace under ``torch.compile``. On CUDA tensors both run
Triton kernels (``_weighted_sum_triton``, imported at the first CUDA call); everywhere else, and
on CUDA when Triton cannot be imported (after one warning), the pure-torch twins here run.
Loading the Triton kernels also checks where Triton will compile them: a cache folder on a
network filesystem gets one warning naming the fix (`deepshard.kernels._cache_dir`).
"""

from __future__ import annotations

import functools
import importlib
import warnings
from types import ModuleType
from typing import Any

import torch

from deepshard.kernels._cache_dir import filesystem_type, triton_cache_dir, warn_if_network_cache

__all__ = ["fused_weighted_sum", "fused_weighted_sum_status", "reference_fused_weighted_sum"]

_ROW_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def fused_weighted_sum(
    rows: torch.Tensor, scores: torch.Tensor, index: torch.Tensor
) -> torch.Tensor:
    """Restores expert-sorted rows into weighted token rows: ``sum_k scores[t,k]·rows[index[t,k]]``.

    Differentiable in ``rows`` and ``scores``; accumulation is fp32 whatever the rows' dtype.

    Args:
        rows: ``[N, H]`` expert outputs in expert-sorted order (fp32, bf16 or fp16), ``N >= 1``.
        scores: ``[T, K]`` routing weights (any floating dtype; read in fp32).
        index: ``[T, K]`` int64 (or int32) row of each (token, choice) in ``rows``, in
            ``[0, N)``: the inverse of the permutation that sorted the ``T·K`` rows by expert.

    Returns:
        ``[T, H]`` in ``rows.dtype``.

    Raises:
        TypeError: A dtype is not supported.
        ValueError: The shapes or devices do not fit together.
    """
    _check("fused_weighted_sum", rows, scores, index)
    out: torch.Tensor = _weighted_sum_op(rows, scores, index.long())
    return out


def reference_fused_weighted_sum(
    rows: torch.Tensor, scores: torch.Tensor, index: torch.Tensor
) -> torch.Tensor:
    """The pure-torch twin of `fused_weighted_sum` (plain autograd, no custom op).

    Takes the same arguments and raises the same errors; what the op runs where no compiled
    kernel serves the tensors.
    """
    _check("reference_fused_weighted_sum", rows, scores, index)
    return _twin_forward(rows, scores, index.long())


def _twin_forward(rows: torch.Tensor, scores: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """One batched ``[1, K] @ [K, H]`` product per token over the gathered rows, in fp32."""
    tokens, k = index.shape
    gathered = rows.index_select(0, index.reshape(-1)).view(tokens, k, -1).float()
    return torch.bmm(scores.float().unsqueeze(1), gathered).squeeze(1).to(rows.dtype)


def _twin_backward(
    grad_out: torch.Tensor, rows: torch.Tensor, scores: torch.Tensor, index: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The twin of the backward: scatter-add into the rows, fp32 dot products for the scores."""
    tokens, k = index.shape
    grad32 = grad_out.float()
    per_choice = scores.float().unsqueeze(-1) * grad32.unsqueeze(1)  # [T, K, H]
    grad_rows = torch.zeros(rows.shape, dtype=torch.float32, device=rows.device)
    grad_rows.index_add_(0, index.reshape(-1), per_choice.reshape(tokens * k, -1))
    gathered = rows.index_select(0, index.reshape(-1)).view(tokens, k, -1).float()
    grad_scores = torch.bmm(gathered, grad32.unsqueeze(-1)).squeeze(-1)
    return grad_rows.to(rows.dtype), grad_scores.to(scores.dtype)


@torch.library.custom_op("deepshard::fused_weighted_sum", mutates_args=())
def _weighted_sum_op(rows: torch.Tensor, scores: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    return _twin_forward(rows, scores, index)


@_weighted_sum_op.register_fake
def _weighted_sum_fake(
    rows: torch.Tensor, scores: torch.Tensor, index: torch.Tensor
) -> torch.Tensor:
    return rows.new_empty((index.shape[0], rows.shape[1]))


@torch.library.custom_op("deepshard::fused_weighted_sum_backward", mutates_args=())
def _weighted_sum_backward_op(
    grad_out: torch.Tensor, rows: torch.Tensor, scores: torch.Tensor, index: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    return _twin_backward(grad_out, rows, scores, index)


@_weighted_sum_backward_op.register_fake
def _weighted_sum_backward_fake(
    grad_out: torch.Tensor, rows: torch.Tensor, scores: torch.Tensor, index: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(rows), torch.empty_like(scores)


@_weighted_sum_op.register_kernel("cuda")
def _weighted_sum_cuda(
    rows: torch.Tensor, scores: torch.Tensor, index: torch.Tensor
) -> torch.Tensor:
    triton_kernels = _triton_kernels()
    if triton_kernels is None:
        return _twin_forward(rows, scores, index)
    out: torch.Tensor = triton_kernels.forward(rows, scores, index)
    return out


@_weighted_sum_backward_op.register_kernel("cuda")
def _weighted_sum_backward_cuda(
    grad_out: torch.Tensor, rows: torch.Tensor, scores: torch.Tensor, index: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    triton_kernels = _triton_kernels()
    if triton_kernels is None:
        return _twin_backward(grad_out, rows, scores, index)
    grads: tuple[torch.Tensor, torch.Tensor] = triton_kernels.backward(
        grad_out, rows, scores, index
    )
    return grads


def fused_weighted_sum_status() -> tuple[bool, str]:
    """Says whether the Triton kernels serve CUDA tensors here, importing Triton if need be.

    Returns:
        ``(True, description)`` when Triton imports and a CUDA device is visible; otherwise
        ``(False, reason)`` saying what runs instead and why.
    """
    try:
        import triton
    except ImportError as exc:
        return False, f"Triton cannot be imported ({exc}): every device runs the pure-torch twin"
    if not torch.cuda.is_available():
        return (
            False,
            f"no CUDA device: the twin runs (Triton {triton.__version__} would serve CUDA)",
        )
    folder = triton_cache_dir()
    where = f"kernel cache {folder} on {filesystem_type(folder) or 'an unknown filesystem'}"
    return True, f"Triton {triton.__version__} kernels for CUDA tensors (twin elsewhere); {where}"


@functools.cache
def _triton_kernels() -> ModuleType | None:
    """The Triton kernels module, or None after one warning saying why it cannot load."""
    try:
        kernels = importlib.import_module("deepshard.kernels._weighted_sum_triton")
    except ImportError as exc:
        warnings.warn(
            f"fused_weighted_sum: Triton is unavailable ({exc}), so CUDA tensors use the "
            "pure-torch twin; install triton (it comes with PyTorch's Linux CUDA wheels)",
            RuntimeWarning,
            stacklevel=3,
        )
        return None
    warn_if_network_cache()  # Triton compiles into its cache folder at the first launch
    return kernels


def _setup_context(ctx: Any, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> None:
    rows, scores, index = inputs
    ctx.save_for_backward(rows, scores, index)


def _backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    rows, scores, index = ctx.saved_tensors
    grad_rows, grad_scores = _weighted_sum_backward_op(grad_out.contiguous(), rows, scores, index)
    return (
        grad_rows if ctx.needs_input_grad[0] else None,
        grad_scores if ctx.needs_input_grad[1] else None,
        None,
    )


_weighted_sum_op.register_autograd(_backward, setup_context=_setup_context)


def _check(op: str, rows: torch.Tensor, scores: torch.Tensor, index: torch.Tensor) -> None:
    """Raises TypeError / ValueError naming the argument and what it must be."""
    for name, tensor in (("rows", rows), ("scores", scores), ("index", index)):
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a tensor, got {type(tensor).__name__}")
    if rows.dtype not in _ROW_DTYPES:
        raise TypeError(f"{op}: rows must be fp32, bf16 or fp16, got {rows.dtype}")
    if not scores.is_floating_point():
        raise TypeError(f"{op}: scores must be a floating tensor, got {scores.dtype}")
    if index.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"{op}: index must be int64 or int32, got {index.dtype}")
    if rows.dim() != 2 or rows.shape[0] == 0:
        raise ValueError(f"{op}: rows must be [N >= 1, H], got shape {tuple(rows.shape)}")
    if scores.dim() != 2 or tuple(index.shape) != tuple(scores.shape):
        raise ValueError(
            f"{op}: scores and index must both be [T, K], got {tuple(scores.shape)} and "
            f"{tuple(index.shape)}"
        )
    if len({rows.device, scores.device, index.device}) != 1:
        raise ValueError(
            f"{op}: rows, scores and index must be on one device, got {rows.device}, "
            f"{scores.device}, {index.device}"
        )
    # The range check reads the index, a device sync on an accelerator: it runs on CPU (where an
    # out-of-range row would be a bare IndexError deep in index_select) and outside tracing.
    if index.numel() and index.device.type == "cpu" and not torch.compiler.is_compiling():
        low, high = int(index.min()), int(index.max())
        if low < 0 or high >= rows.shape[0]:
            raise ValueError(
                f"{op}: index values must be in [0, {rows.shape[0]}) (rows), got [{low}, {high}]"
            )
