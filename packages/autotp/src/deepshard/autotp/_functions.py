"""The autograd functions of the tensor-parallel layers: collectives placed in forward/backward.

Each function is a pure function of tensors, a `LayerPlan`'s row bookkeeping and the ``tp``
process group; the rank is read from the group it is given, never from a global.

* **Column** (``y = x Wᵣᵀ + bᵣ``, rank ``r`` holding rows of ``W``): the input ``x`` is whole on
  every rank and the output is this rank's slice of the features. The gradient of ``x`` is a
  sum over the ranks of ``gᵣ Wᵣ``, so backward all-reduces it. With ``overlap`` the all-reduce
  is launched asynchronously first and the weight-gradient matmul (which does not need it) runs
  while it is in flight.
* **Row** (``y = Σᵣ xᵣ Wᵣᵀ + b``, rank ``r`` holding columns of ``W``): forward all-reduces the
  partial products and adds the (whole) bias once, after the sum. The gradient of the output is
  whole on every rank, so backward needs no communication.
* **Vocab embedding**: rank ``r`` holds a contiguous range of the vocabulary. Token ids outside
  it look up row 0 and are masked to zero, so the all-reduce of the partial lookups is the full
  lookup; backward scatters the (whole) output gradient into the rows this rank owns.
* **Gather / split along the last dim** (``gather_output`` of a column layer; a row layer given
  a whole input): shards may be uneven and, for fused weights, made of one piece per
  sub-parameter, so the gather pads every shard to the widest, all-gathers, and reassembles the
  pieces in the global order. Each is the other's backward: the gradient of a gathered output
  is the same on every rank, so its backward only keeps this rank's pieces.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from deepshard.comm import all_gather_into_tensor, all_reduce, copy_to_group

__all__ = [
    "all_gather_pieces",
    "assemble",
    "column_linear",
    "copy_to_tp",
    "gather_last_dim",
    "local_pieces",
    "row_linear",
    "split_last_dim",
    "vocab_embedding",
]

Pieces = tuple[tuple[tuple[int, int], ...], ...]
"""Per rank, each sub-parameter's ``(start, length)`` in the full dim (`LayerPlan.offsets`)."""


def local_pieces(
    full: torch.Tensor, offsets: tuple[tuple[int, int], ...], dim: int
) -> torch.Tensor:
    """This rank's shard of ``full``: its piece of each sub-parameter, concatenated along ``dim``.

    Args:
        full: The whole tensor.
        offsets: ``LayerPlan.offsets(rank)``.
        dim: The split dimension.
    """
    return torch.cat([full.narrow(dim, start, length) for start, length in offsets], dim=dim)


def assemble(shards: list[torch.Tensor], pieces: Pieces, dim: int) -> torch.Tensor:
    """The whole tensor from every rank's shard, pieces put back in the global order.

    Args:
        shards: Rank ``r``'s shard (the concatenation of its pieces) at index ``r``.
        pieces: ``LayerPlan.offsets(r)`` for every rank ``r``.
        dim: The split dimension.
    """
    placed: list[tuple[int, torch.Tensor]] = []
    for shard, offsets in zip(shards, pieces, strict=True):
        local = 0
        for start, length in offsets:
            placed.append((start, shard.narrow(dim, local, length)))
            local += length
    placed.sort(key=lambda item: item[0])
    return torch.cat([piece for _, piece in placed], dim=dim)


def all_gather_pieces(
    local: torch.Tensor, pieces: Pieces, rank: int, group: dist.ProcessGroup
) -> torch.Tensor:
    """The whole tensor from every rank's shard along the last dim (no autograd)."""
    widths = [sum(length for _, length in offsets) for offsets in pieces]
    padded = F.pad(local, (0, max(widths) - widths[rank])).contiguous()
    stacked = torch.empty((len(pieces), *padded.shape), dtype=local.dtype, device=local.device)
    all_gather_into_tensor(padded, group=group, output=stacked)
    return assemble(list(stacked.unbind(0)), pieces, dim=-1)


class _GatherLast(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, local: torch.Tensor, pieces: Pieces, rank: int, group: dist.ProcessGroup
    ) -> torch.Tensor:
        ctx.offsets = pieces[rank]
        return all_gather_pieces(local, pieces, rank, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return local_pieces(grad, ctx.offsets, -1), None, None, None


class _SplitLast(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, full: torch.Tensor, pieces: Pieces, rank: int, group: dist.ProcessGroup
    ) -> torch.Tensor:
        ctx.pieces, ctx.rank, ctx.group = pieces, rank, group
        return local_pieces(full, pieces[rank], -1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return (
            all_gather_pieces(grad.contiguous(), ctx.pieces, ctx.rank, ctx.group),
            None,
            None,
            None,
        )


def gather_last_dim(
    local: torch.Tensor, pieces: Pieces, *, rank: int, group: dist.ProcessGroup
) -> torch.Tensor:
    """All-gather uneven (and fused) shards along the last dim into the whole tensor.

    Args:
        local: This rank's shard.
        pieces: ``LayerPlan.offsets(r)`` of every rank ``r``.
        rank: This rank's index in ``group``.
        group: The ``tp`` process group.
    """
    out: torch.Tensor = _GatherLast.apply(local, pieces, rank, group)
    return out


def split_last_dim(
    full: torch.Tensor, pieces: Pieces, *, rank: int, group: dist.ProcessGroup
) -> torch.Tensor:
    """This rank's shard of a tensor that is whole on every rank (backward gathers)."""
    out: torch.Tensor = _SplitLast.apply(full, pieces, rank, group)
    return out


def _rows(t: torch.Tensor) -> torch.Tensor:
    # Not reshape(-1, n): a rank holding no rows has n == 0, for which -1 is ambiguous.
    return t.reshape(math.prod(t.shape[:-1]), t.shape[-1])


def _weight_grads(
    ctx: Any, grad: torch.Tensor, x: torch.Tensor
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    flat_grad, flat_x = _rows(grad), _rows(x)
    grad_weight = flat_grad.t() @ flat_x if ctx.needs_input_grad[1] else None
    grad_bias = flat_grad.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
    return grad_weight, grad_bias


class _ColumnLinear(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        group: dist.ProcessGroup | None,
        overlap: bool,
    ) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.group, ctx.overlap, ctx.has_bias = group, overlap, bias is not None
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        handle, grad_x = None, None
        if ctx.needs_input_grad[0]:
            grad_x = grad @ weight
        if grad_x is not None and ctx.group is not None:
            # Launched before the weight gradient so that, with overlap, the two run together.
            handle = all_reduce(grad_x, group=ctx.group, async_op=ctx.overlap)
        grad_weight, grad_bias = _weight_grads(ctx, grad, x)
        if handle is not None:
            handle.wait()
        return grad_x, grad_weight, grad_bias, None, None


def column_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    *,
    group: dist.ProcessGroup | None,
    overlap: bool = False,
) -> torch.Tensor:
    """``x Wᵀ + b`` with this rank's rows of ``W``; backward all-reduces the gradient of ``x``.

    Args:
        x: The whole input (identical on every rank of ``group``).
        weight: This rank's rows of the weight, ``[local_out, in]``.
        bias: This rank's entries of the bias, or None.
        group: The ``tp`` process group; None leaves the input gradient partial (a block whose
            input is reduced once for all its column layers, see `copy_to_tp`).
        overlap: Launch the input-gradient all-reduce asynchronously and compute the weight
            gradient while it runs (``tensor_parallel.tp_overlap_comm``).
    """
    out: torch.Tensor = _ColumnLinear.apply(x, weight, bias, group, overlap)
    return out


def copy_to_tp(x: torch.Tensor, *, group: dist.ProcessGroup) -> torch.Tensor:
    """Identity in forward; backward all-reduces the gradient over ``group``.

    Put once in front of several column layers that read the same input (built with
    ``group=None`` in `column_linear`), it replaces their separate input-gradient all-reduces
    by one, in a place every rank reaches in the same order.
    """
    return copy_to_group(x, group=group)


class _RowLinear(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        group: dist.ProcessGroup,
    ) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        out = F.linear(x, weight)
        all_reduce(out, group=group)
        return out if bias is None else out + bias

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        grad_x = grad @ weight if ctx.needs_input_grad[0] else None
        grad_weight, grad_bias = _weight_grads(ctx, grad, x)
        return grad_x, grad_weight, grad_bias, None


def row_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, *, group: dist.ProcessGroup
) -> torch.Tensor:
    """``Σᵣ xᵣ Wᵣᵀ + b``: this rank's input features and weight columns; the bias added once.

    Args:
        x: This rank's slice of the input features.
        weight: This rank's columns of the weight, ``[out, local_in]``.
        bias: The whole bias (the same on every rank), or None.
        group: The ``tp`` process group.
    """
    out: torch.Tensor = _RowLinear.apply(x, weight, bias, group)
    return out


class _VocabEmbedding(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        ids: torch.Tensor,
        weight: torch.Tensor,
        start: int,
        padding_idx: int | None,
        group: dist.ProcessGroup,
    ) -> torch.Tensor:
        inside = (ids >= start) & (ids < start + weight.shape[0])
        local = torch.where(inside, ids - start, torch.zeros_like(ids))
        out = F.embedding(local, weight).masked_fill(~inside.unsqueeze(-1), 0.0)
        all_reduce(out, group=group)
        ctx.save_for_backward(local, inside)
        ctx.rows, ctx.padding_row = weight.shape[0], None
        if padding_idx is not None and 0 <= padding_idx - start < weight.shape[0]:
            ctx.padding_row = padding_idx - start
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        local, inside = ctx.saved_tensors
        grad_weight = grad.new_zeros((ctx.rows, grad.shape[-1]))
        grad_weight.index_add_(0, local[inside], grad[inside])
        if ctx.padding_row is not None:  # nn.Embedding never updates its padding row
            grad_weight[ctx.padding_row] = 0.0
        return None, grad_weight, None, None, None


def vocab_embedding(
    ids: torch.Tensor,
    weight: torch.Tensor,
    *,
    start: int,
    padding_idx: int | None,
    group: dist.ProcessGroup,
) -> torch.Tensor:
    """The lookup of ``ids`` in a vocabulary split over ``group``, rows ``start..`` held here.

    Args:
        ids: Token ids (the same on every rank).
        weight: This rank's rows of the embedding, ``[local_vocab, hidden]``.
        start: The first vocabulary id this rank holds.
        padding_idx: The embedding's padding id (its row gets no gradient), or None.
        group: The ``tp`` process group.
    """
    out: torch.Tensor = _VocabEmbedding.apply(ids, weight, start, padding_idx, group)
    return out
