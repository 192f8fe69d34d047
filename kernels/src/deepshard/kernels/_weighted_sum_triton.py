"""Triton kernels of ``deepshard::fused_weighted_sum`` for CUDA tensors.

Imported only by the op's CUDA implementation (``_weighted_sum``), never at package import:
importing Triton costs a second and is not needed on CPU.

- Forward: one program per (token, block of ``BLOCK_H`` columns) reads the token's ``K`` rows
  once, accumulates ``score · row`` in fp32 registers and writes the output block once, in the
  rows' dtype. No ``[T, K, H]`` temporary.
- Backward: one program per token; for each of its ``K`` routes it streams the route's row and
  the output gradient over ``H`` once, accumulating the fp32 dot product (the score's gradient)
  and adding ``score · grad_out`` into an fp32 row-gradient buffer. The add is atomic so an
  ``index`` that names a row twice is still summed correctly (a MoE's index names each row at
  most once, so there is no contention); rows nobody names stay zero.

The tests run these kernels on CPU tensors under ``TRITON_INTERPRET=1`` (no GPU needed) and on a
GPU where one is present.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

__all__ = ["backward", "forward"]

# Widest column block: 1024 fp32 accumulators per program is what one warp group holds well.
_MAX_BLOCK_H = 1024


@triton.jit
def _forward_kernel(
    rows_ptr: Any,
    scores_ptr: Any,
    index_ptr: Any,
    out_ptr: Any,
    hidden: Any,
    K: tl.constexpr,
    BLOCK_H: tl.constexpr,
) -> None:
    token = tl.program_id(0).to(tl.int64)
    columns = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    inside = columns < hidden
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for k in tl.static_range(K):
        row = tl.load(index_ptr + token * K + k).to(tl.int64)
        score = tl.load(scores_ptr + token * K + k).to(tl.float32)
        values = tl.load(rows_ptr + row * hidden + columns, mask=inside, other=0.0)
        acc += score * values.to(tl.float32)
    tl.store(out_ptr + token * hidden + columns, acc.to(out_ptr.dtype.element_ty), mask=inside)


@triton.jit
def _backward_kernel(
    grad_out_ptr: Any,
    rows_ptr: Any,
    scores_ptr: Any,
    index_ptr: Any,
    grad_rows_ptr: Any,
    grad_scores_ptr: Any,
    hidden: Any,
    K: tl.constexpr,
    BLOCK_H: tl.constexpr,
) -> None:
    token = tl.program_id(0).to(tl.int64)
    for k in tl.static_range(K):
        row = tl.load(index_ptr + token * K + k).to(tl.int64)
        score = tl.load(scores_ptr + token * K + k).to(tl.float32)
        dot = tl.zeros([BLOCK_H], dtype=tl.float32)
        for start in range(0, hidden, BLOCK_H):
            columns = start + tl.arange(0, BLOCK_H)
            inside = columns < hidden
            grad = tl.load(grad_out_ptr + token * hidden + columns, mask=inside, other=0.0)
            grad = grad.to(tl.float32)
            values = tl.load(rows_ptr + row * hidden + columns, mask=inside, other=0.0)
            dot += values.to(tl.float32) * grad
            tl.atomic_add(grad_rows_ptr + row * hidden + columns, score * grad, mask=inside)
        tl.store(grad_scores_ptr + token * K + k, tl.sum(dot, axis=0))


def _block(hidden: int) -> int:
    return int(min(_MAX_BLOCK_H, triton.next_power_of_2(max(hidden, 1))))


def forward(rows: torch.Tensor, scores: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``out[t] = Σ_k scores[t, k] · rows[index[t, k]]`` (arguments checked by the caller)."""
    rows, scores, index = rows.contiguous(), scores.contiguous(), index.contiguous()
    tokens, k = index.shape
    hidden = rows.shape[1]
    out = rows.new_empty((tokens, hidden))
    if tokens and hidden:
        block = _block(hidden)
        grid = (tokens, triton.cdiv(hidden, block))
        _forward_kernel[grid](rows, scores, index, out, hidden, K=k, BLOCK_H=block)
    return out


def backward(
    grad_out: torch.Tensor, rows: torch.Tensor, scores: torch.Tensor, index: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradients of `forward` for ``rows`` (rows' dtype) and ``scores`` (scores' dtype)."""
    grad_out, rows = grad_out.contiguous(), rows.contiguous()
    scores, index = scores.contiguous(), index.contiguous()
    tokens, k = index.shape
    hidden = rows.shape[1]
    grad_rows = torch.zeros(rows.shape, dtype=torch.float32, device=rows.device)
    grad_scores = torch.zeros((tokens, k), dtype=torch.float32, device=rows.device)
    if tokens and hidden:
        _backward_kernel[(tokens,)](
            grad_out, rows, scores, index, grad_rows, grad_scores, hidden,
            K=k, BLOCK_H=_block(hidden),
        )  # fmt: skip
    return grad_rows.to(rows.dtype), grad_scores.to(scores.dtype)
