"""Gradients of replicated parameters that act on sharded activations, summed over TP.

A parameter kept whole on every TP rank but applied to this rank's part of the activations
(Qwen3's ``q_norm`` / ``k_norm`` act on this rank's heads) gets only a partial gradient on each
rank; the true gradient is the sum over the group.

One `ReplicatedGradReducer` per model does the sum with a single all-reduce per backward:

1. a gradient hook on each such parameter (``Tensor.register_hook``: it sees the gradient of
   this backward before it is accumulated into ``.grad``) records it and, the first time in a
   backward, queues a callback for the end of the backward pass;
2. the callback all-reduces every recorded gradient in one flat buffer, in the fixed order of
   parameter names, and adds the other ranks' parts to ``.grad``.

Summing at the end, in name order, keeps the collective sequence the same on every rank
however autograd orders the hooks (a rank that holds no attention heads runs a different
graph), and accumulation over micro-batches stays a plain sum. The reducer holds the group
and weak references to the parameters only, so it never keeps a model alive.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from deepshard.comm import all_reduce

__all__ = ["ReplicatedGradReducer"]


class ReplicatedGradReducer:
    """Sums the gradients of ``params`` over the TP group once per backward.

    Args:
        params: ``(name, parameter)`` pairs; the order of names fixes the buffer layout.
        group: The ``tp`` process group.
    """

    def __init__(self, params: Sequence[tuple[str, nn.Parameter]], group: dist.ProcessGroup):
        ordered = sorted(params, key=lambda item: item[0])
        self.names = tuple(name for name, _ in ordered)
        self._params = [weakref.ref(param) for _, param in ordered]
        self._group = group
        self._pending: dict[int, torch.Tensor] = {}
        self._queued = False
        for index, (_, param) in enumerate(ordered):
            param.register_hook(_Recorder(weakref.ref(self), index))

    def record(self, index: int, grad: torch.Tensor) -> None:
        """Keep this backward's gradient of parameter ``index``; queue the reduction once."""
        previous = self._pending.get(index)
        self._pending[index] = grad if previous is None else previous + grad
        if not self._queued:
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self.reduce)

    def reduce(self) -> None:
        """All-reduce what this backward recorded and add the other ranks' parts to ``.grad``."""
        self._queued = False
        pending, self._pending = self._pending, {}
        params = [ref() for ref in self._params]
        live = [(i, p) for i, p in enumerate(params) if p is not None]
        if not live:
            return
        parts = [pending.get(i, torch.zeros_like(p)).reshape(-1) for i, p in live]
        flat = torch.cat([part.to(live[0][1].dtype) for part in parts])
        all_reduce(flat, group=self._group)
        offset = 0
        for (_, param), part in zip(live, parts, strict=True):
            total = flat[offset : offset + part.numel()].view_as(param).to(param.dtype)
            offset += part.numel()
            with torch.no_grad():
                if param.grad is None:
                    param.grad = total.clone()
                else:  # .grad already holds this rank's part (and earlier micro-batches')
                    param.grad.add_(total - part.view_as(param).to(param.dtype))


class _Recorder:
    """The hook on one parameter: hands its gradient to the reducer, returns it unchanged."""

    def __init__(self, reducer: weakref.ref[ReplicatedGradReducer], index: int) -> None:
        self._reducer, self._index = reducer, index

    def __call__(self, grad: torch.Tensor) -> torch.Tensor:
        reducer = self._reducer()
        if reducer is not None:
            reducer.record(self._index, grad.detach().clone())
        return grad
