"""The two all-reduces that tensor-parallel layers differentiate through.

A layer split over a group (tensor parallelism, a tensor-parallel expert) reads one input that
every rank of the group holds whole and produces, on each rank, a part of its output:

* `copy_to_group` marks where the whole input enters: identity forward; in backward every rank
  holds only its part's contribution to the input's gradient, so the gradient is all-reduced.
* `reduce_from_group` marks where the parts are summed into the whole output: all-reduce
  forward; in backward the output's gradient is already whole and alike on every rank (what
  follows runs replicated), so it passes through unchanged.

The pair is Megatron-LM's ``copy_to``/``reduce_from`` tensor-model-parallel regions. Both are
functions of a tensor and a group; the group is any that `deepshard.comm.all_reduce` accepts.
"""

from __future__ import annotations

from typing import Any

import torch

from deepshard.comm._groups import Group
from deepshard.comm.collectives import all_reduce

__all__ = ["copy_to_group", "reduce_from_group"]


class _CopyTo(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        summed = grad.clone()
        all_reduce(summed, group=ctx.group)
        return summed, None


class _ReduceFrom(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group) -> torch.Tensor:
        summed = x.clone()
        all_reduce(summed, group=group)
        return summed

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return grad, None


def copy_to_group(x: torch.Tensor, *, group: Group) -> torch.Tensor:
    """Identity forward; backward all-reduces (sums) the gradient over ``group``."""
    out: torch.Tensor = _CopyTo.apply(x, group)
    return out


def reduce_from_group(x: torch.Tensor, *, group: Group) -> torch.Tensor:
    """All-reduce (sum) over ``group`` forward, a new tensor; backward passes the gradient."""
    out: torch.Tensor = _ReduceFrom.apply(x, group)
    return out
