"""The sequence-parallel exchange as a registered operator: `deepshard_sp::all_to_all`.

An all-to-all along dim 0 with explicit per-rank split sizes, registered with `torch.library`
so that `torch.compile` sees an opaque operator with a known output shape (the fake
implementation) and a known derivative (the registered autograd formula), instead of tracing
into a collective that writes a pre-allocated buffer. The latter is what made DeepSpeed's
compiled exchange silently return zero gradients (v0.19.7, #8491): the traced graph's output
did not depend on its input, so nothing flowed back.

The backward of an all-to-all is the all-to-all with the split sizes swapped: the rows this
rank received from rank `j` go back to `j` as gradient, and what it sent to `j` comes back.
The collective itself is `deepshard.comm.all_to_all_single`.

A process group cannot appear in an operator schema, so the op names its group by
`ProcessGroup.group_name` and resolves it through PyTorch's own group registry (the same one
its functional collectives use); DeepShard keeps no registry of its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import GroupName, _resolve_process_group

import deepshard.comm as comm

__all__ = ["exchange", "resolve_group_by_name"]


def resolve_group_by_name(group_name: str) -> dist.ProcessGroup:
    """The process group whose `group_name` is `group_name` (PyTorch's registry)."""
    return _resolve_process_group(GroupName(group_name))


@torch.library.custom_op("deepshard_sp::all_to_all", mutates_args=())
def _all_to_all(
    input: torch.Tensor,
    group_name: str,
    output_split_sizes: list[int],
    input_split_sizes: list[int],
) -> torch.Tensor:
    handle = comm.all_to_all_single(
        input.contiguous(),
        group=resolve_group_by_name(group_name),
        output_split_sizes=output_split_sizes,
        input_split_sizes=input_split_sizes,
    )
    return handle.wait()


@_all_to_all.register_fake
def _all_to_all_fake(
    input: torch.Tensor,
    group_name: str,
    output_split_sizes: list[int],
    input_split_sizes: list[int],
) -> torch.Tensor:
    return input.new_empty((sum(output_split_sizes), *input.shape[1:]))


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
    _, ctx.group_name, ctx.output_split_sizes, ctx.input_split_sizes = inputs


def _backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, None, None, None]:
    # Swapped splits: the gradient rows travel back to the ranks they came from.
    back = _all_to_all(grad, ctx.group_name, ctx.input_split_sizes, ctx.output_split_sizes)
    return back, None, None, None


_all_to_all.register_autograd(_backward, setup_context=_setup_context)


def exchange(
    input: torch.Tensor,
    group_name: str,
    output_split_sizes: Sequence[int],
    input_split_sizes: Sequence[int],
) -> torch.Tensor:
    """All-to-all along dim 0 that autograd and `torch.compile` differentiate.

    Args:
        input: Rows to send; `input_split_sizes[j]` rows go to group rank `j`.
        group_name: `ProcessGroup.group_name` of the group.
        output_split_sizes: Rows received from each group rank, concatenated in rank order.
        input_split_sizes: Rows sent to each group rank.

    Returns:
        The received rows, `(sum(output_split_sizes), *input.shape[1:])`.
    """
    out: torch.Tensor = torch.ops.deepshard_sp.all_to_all(
        input.contiguous(), group_name, list(output_split_sizes), list(input_split_sizes)
    )
    return out
