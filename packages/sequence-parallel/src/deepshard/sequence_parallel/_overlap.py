"""The overlapped backward of the q/k exchange: launch asynchronously, finish in a tensor hook.

With `overlap=True` the backward of the q and k exchanges does not wait for its all-to-all.
`_ScatterHeadsAsyncGrad.backward` packs the incoming gradient, launches the collective with
`async_op=True`, keeps the handle in a `PendingGrad` owned by this one call, and returns a view
of the (still unfilled) receive buffer, already in the caller's layout. Autograd then runs the
other ready nodes (the v exchange, the other tensor's launch) while the data moves. The hook
on the function's input waits on the handle and returns the finished gradient, permuted into
the caller's layout from the handle's output: the gradient is complete before any other node
reads it.

The hook sits on a private alias of the caller's tensor (`x.view_as(x)`) whose only consumer
is the exchange, so its gradient is exactly the exchange's: if the caller's `q` also feeds
another op, autograd's summation of the two gradients happens after the hook, on a finished
tensor. Which layout the gradient is returned in never depends on how the caller produced `q`
(a transpose, a view, `unbind` of a packed QKV, a leaf): DeepSpeed re-permuted in the hook
with parameters of the wrong direction and corrupted these gradients (v0.19.7, #8342).

Eager only: under `torch.compile` the synchronous registered op is used instead.
"""

from __future__ import annotations

from typing import Any

import torch

import deepshard.comm as comm
from deepshard.comm import CommHandle
from deepshard.sequence_parallel._exchange_op import resolve_group_by_name
from deepshard.sequence_parallel._layout import (
    ExchangeSpec,
    pack_seq_chunks,
    scatter_heads,
    unpack_gathered_heads,
)

__all__ = ["PendingGrad", "scatter_heads_overlapped"]


class PendingGrad:
    """The in-flight gradient exchange of one tensor in one backward pass."""

    __slots__ = ("handle",)

    def __init__(self) -> None:
        self.handle: CommHandle[torch.Tensor] | None = None

    def finish(self, grad: torch.Tensor) -> torch.Tensor:
        """Tensor hook: wait for the exchange and return the gradient in the caller's layout.

        Args:
            grad: The placeholder the backward returned (a view of the receive buffer).

        Returns:
            The received gradient, `[A, B, h, d]`, contiguous.
        """
        if self.handle is None:  # the exchange's backward did not run (e.g. no grad needed)
            return grad
        received = self.handle.wait()
        self.handle = None
        return unpack_gathered_heads(received).contiguous()


class _ScatterHeadsAsyncGrad(torch.autograd.Function):
    """`scatter_heads` whose backward launches its all-to-all without waiting."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, spec: ExchangeSpec, pending: PendingGrad) -> Any:
        ctx.spec, ctx.pending = spec, pending
        return scatter_heads(x, spec)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        spec: ExchangeSpec = ctx.spec
        send = pack_seq_chunks(grad, spec).contiguous()
        buffer = send.new_empty((sum(spec.head_splits), *send.shape[1:]))
        ctx.pending.handle = comm.all_to_all_single(
            send,
            group=resolve_group_by_name(spec.group_name),
            output_split_sizes=spec.head_splits,
            input_split_sizes=[spec.local_heads] * spec.world_size,
            output=buffer,
            async_op=True,
        )
        # The buffer's content is valid only after the hook has waited; its shape and layout
        # are already the input's, which is all autograd checks here.
        return unpack_gathered_heads(buffer), None, None


def scatter_heads_overlapped(x: torch.Tensor, spec: ExchangeSpec) -> torch.Tensor:
    """`scatter_heads` with the overlapped backward described in the module docstring.

    Args:
        x: `[b, s/P, h, d]` or `[s/P, b, h, d]`.
        spec: Group, layout and head split.

    Returns:
        `[b, s, h_r, d]` or `[s, b, h_r, d]`, like `scatter_heads`.
    """
    if not x.requires_grad:
        return scatter_heads(x, spec)
    alias = x.view_as(x)
    pending = PendingGrad()
    alias.register_hook(pending.finish)  # type: ignore[no-untyped-call]
    out: torch.Tensor = _ScatterHeadsAsyncGrad.apply(alias, spec, pending)
    return out
