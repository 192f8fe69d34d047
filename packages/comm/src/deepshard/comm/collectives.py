"""Collectives as pure functions of (tensors, group), each returning a `CommHandle`.

Every function takes its group keyword-only: a `ProcessGroup`, or a 1-D `DeviceMesh` such as
`mesh["tp"]`; without one it runs on the default (world) group, as `torch.distributed` and
`deepspeed.comm` do (DeepShard's own packages always pass their group). All ranks of the group
must call the same function with matching shapes, like any `torch.distributed` collective,
which these wrap (nothing is re-implemented). What DeepShard adds:

* one handle type for sync and async calls; `wait()` may be repeated and returns the output;
* reduction ops by name (`"sum"`, `"avg"`, `"max"`, `"min"`, `"product"`) or `ReduceOp`;
  `"avg"` runs natively on nccl/xccl and as a sum followed by a division by the group size on
  other backends (older gloo has no AVG), so the result is the same everywhere;
* optional outputs, allocated with the shape the collective implies;
* checks with actionable errors (`CommError`) before anything reaches the backend;
* per-call logging through an optional `deepshard.comm.logger.CommsLogger`;
* a bounded wait that names the ranks a hung collective waits for, through an optional
  `deepshard.comm.watchdog.CommWatchdog` (passed directly or carried by the logger).

Ranks such as `group_src` are ranks *within the group*, not global ranks.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from deepshard.comm._groups import (
    Group,
    ReduceOpLike,
    barrier_device_ids,
    check_output,
    resolve_group,
    resolve_reduce_op,
)
from deepshard.comm._handles import CommHandle
from deepshard.comm._issue import flat_view, issue, plan_reduction
from deepshard.comm._splits import a2a_output_rows, check_split_sizes
from deepshard.comm.logger import CommsLogger
from deepshard.comm.watchdog import CommWatchdog
from deepshard.interface.errors import CommError

__all__ = [
    "all_gather_into_tensor",
    "all_reduce",
    "all_to_all_single",
    "barrier",
    "broadcast",
    "reduce_scatter_tensor",
]


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def all_reduce(
    tensor: torch.Tensor,
    *,
    group: Group | None = None,
    op: ReduceOpLike = "sum",
    async_op: bool = False,
    logger: CommsLogger | None = None,
    log_name: str | None = None,
    watchdog: CommWatchdog | None = None,
) -> CommHandle[torch.Tensor]:
    """Reduce `tensor` over the group, in place.

    Args:
        tensor: Input and output; read it only after `wait()`.
        group: A ProcessGroup or a 1-D DeviceMesh; the default (world) group when `None`.
        op: `"sum"`, `"avg"`, `"max"`, `"min"`, `"product"` or a `ReduceOp`.
        async_op: Return before completion; `wait()` on the handle completes the call.
        logger: Records the call when given and enabled.
        log_name: Name in the logger; the op's name (`"all_reduce"`) when `None`.
        watchdog: Bounds the wait and reports a hang; the logger's watchdog when `None`.

    Returns:
        A handle whose `wait()` returns `tensor`.

    Raises:
        CommError: On a bad group or op, or `"avg"` of a non-float tensor.
    """
    pg = resolve_group(group)
    red, after = plan_reduction(resolve_reduce_op(op), pg, input=tensor, output=tensor)
    handle = issue(
        "all_reduce",
        pg=pg,
        launch=lambda a: dist.all_reduce(tensor, op=red, group=pg, async_op=a),
        output=tensor,
        msg_bytes=_nbytes(tensor),
        device=tensor.device,
        async_op=async_op,
        logger=logger,
        log_name=log_name,
        input=tensor,
        watchdog=watchdog,
        after=after,
    )
    return handle  # type: ignore[return-value]


def all_gather_into_tensor(
    input: torch.Tensor,
    *,
    group: Group | None = None,
    output: torch.Tensor | None = None,
    async_op: bool = False,
    logger: CommsLogger | None = None,
    log_name: str | None = None,
    watchdog: CommWatchdog | None = None,
) -> CommHandle[torch.Tensor]:
    """Concatenate every rank's `input` along dim 0, in group-rank order.

    Args:
        input: This rank's shard; the same shape on every rank.
        group: A ProcessGroup or a 1-D DeviceMesh; the default (world) group when `None`.
        output: Where to gather: shape `(size * input.shape[0], *input.shape[1:])`
            (concatenated, allocated when `None`) or `(size, *input.shape)` (stacked); `(size,)`
            for a 0-d input.
        async_op: Return before completion.
        logger: Records the call (bytes = the full gathered output, as nccl-tests counts).
        log_name: Name in the logger; `"all_gather_into_tensor"` when `None`.
        watchdog: Bounds the wait and reports a hang; the logger's watchdog when `None`.

    Returns:
        A handle whose `wait()` returns the gathered tensor.

    Raises:
        CommError: On a bad group, or an `output` of the wrong size, dtype or device.
    """
    pg = resolve_group(group)
    size = pg.size()
    if input.dim() == 0:
        shapes: list[tuple[int, ...]] = [(size,)]
    else:  # concatenated along dim 0, or stacked along a new dim 0 (torch accepts both)
        shapes = [(size * input.shape[0], *input.shape[1:]), (size, *input.shape)]
    if output is None:
        output = input.new_empty(shapes[0])
    else:
        check_output(output, input, accepted_shapes=shapes, what="gathered output")
    out = output
    # Backends (gloo) refuse a 0-d input; as a 1-element tensor it gathers into (size,).
    shard = input.reshape(1) if input.dim() == 0 else input
    # gloo takes only the concatenated shape; a contiguous stacked output has the same layout.
    target = out if tuple(out.shape) == shapes[0] else flat_view(out, shapes[0])
    handle = issue(
        "all_gather_into_tensor",
        pg=pg,
        launch=lambda a: dist.all_gather_into_tensor(target, shard, group=pg, async_op=a),
        output=out,
        msg_bytes=_nbytes(out),
        device=input.device,
        async_op=async_op,
        logger=logger,
        log_name=log_name,
        input=input,
        watchdog=watchdog,
    )
    return handle  # type: ignore[return-value]


def reduce_scatter_tensor(
    input: torch.Tensor,
    *,
    group: Group | None = None,
    op: ReduceOpLike = "sum",
    output: torch.Tensor | None = None,
    async_op: bool = False,
    logger: CommsLogger | None = None,
    log_name: str | None = None,
    watchdog: CommWatchdog | None = None,
) -> CommHandle[torch.Tensor]:
    """Reduce `input` over the group and give group rank `r` its `r`-th chunk along dim 0.

    Args:
        input: The full tensor on every rank; `input.shape[0]` must divide by the group size.
        group: A ProcessGroup or a 1-D DeviceMesh; the default (world) group when `None`.
        op: `"sum"`, `"avg"`, `"max"`, `"min"`, `"product"` or a `ReduceOp`.
        output: Where this rank's chunk goes, shape `(input.shape[0] // size, *input.shape[1:])`;
            allocated when `None`.
        async_op: Return before completion.
        logger: Records the call (bytes = the full input, as nccl-tests counts).
        log_name: Name in the logger; `"reduce_scatter_tensor"` when `None`.
        watchdog: Bounds the wait and reports a hang; the logger's watchdog when `None`.

    Returns:
        A handle whose `wait()` returns this rank's reduced chunk.

    Raises:
        CommError: On a bad group or op, a dim 0 not divisible by the group size, a wrong
            `output`, or `"avg"` of a non-float tensor.
    """
    pg = resolve_group(group)
    size = pg.size()
    if input.dim() == 0 or input.shape[0] % size != 0:
        raise CommError(
            f"reduce_scatter_tensor needs input dim 0 divisible by the group size {size}, got "
            f"shape {tuple(input.shape)}; pad the input along dim 0."
        )
    chunk_shape = (input.shape[0] // size, *input.shape[1:])
    if output is None:
        output = input.new_empty(chunk_shape)
    else:
        check_output(output, input, accepted_shapes=[chunk_shape], what="scattered chunk")
    out = output
    red, after = plan_reduction(resolve_reduce_op(op), pg, input=input, output=out)
    handle = issue(
        "reduce_scatter_tensor",
        pg=pg,
        launch=lambda a: dist.reduce_scatter_tensor(out, input, op=red, group=pg, async_op=a),
        output=out,
        msg_bytes=_nbytes(input),
        device=input.device,
        async_op=async_op,
        logger=logger,
        log_name=log_name,
        input=input,
        watchdog=watchdog,
        after=after,
    )
    return handle  # type: ignore[return-value]


def all_to_all_single(
    input: torch.Tensor,
    *,
    group: Group | None = None,
    output_split_sizes: Sequence[int] | None = None,
    input_split_sizes: Sequence[int] | None = None,
    output: torch.Tensor | None = None,
    async_op: bool = False,
    logger: CommsLogger | None = None,
    log_name: str | None = None,
    watchdog: CommWatchdog | None = None,
) -> CommHandle[torch.Tensor]:
    """Send rows of `input` to every rank and receive theirs, along dim 0.

    Group rank `j` receives `input[offset_j : offset_j + input_split_sizes[j]]` from this rank;
    this rank's output holds, in group-rank order, what every rank sent to it. Without split
    sizes, dim 0 is cut into equal parts.

    Args:
        input: Rows to send.
        group: A ProcessGroup or a 1-D DeviceMesh; the default (world) group when `None`.
        output_split_sizes: Rows this rank receives from each group rank.
        input_split_sizes: Rows this rank sends to each group rank.
        output: Where to receive; allocated when `None` (then uneven splits need
            `output_split_sizes`).
        async_op: Return before completion.
        logger: Records the call (bytes = this rank's input).
        log_name: Name in the logger; `"all_to_all_single"` when `None`.
        watchdog: Bounds the wait and reports a hang; the logger's watchdog when `None`.

    Returns:
        A handle whose `wait()` returns the received tensor.

    Raises:
        CommError: On a bad group, splits of the wrong length or sum, or an output that cannot
            be sized.
    """
    pg = resolve_group(group)
    size = pg.size()
    in_splits = check_split_sizes(input_split_sizes, size, input, "input_split_sizes")
    if output is None:
        rows = a2a_output_rows(input, size, output_split_sizes, in_splits)
        output = input.new_empty((rows, *input.shape[1:]))
    out_splits = check_split_sizes(output_split_sizes, size, output, "output_split_sizes")
    out = output
    handle = issue(
        "all_to_all_single",
        pg=pg,
        launch=lambda a: dist.all_to_all_single(
            out, input, out_splits, in_splits, group=pg, async_op=a
        ),
        output=out,
        msg_bytes=_nbytes(input),
        device=input.device,
        async_op=async_op,
        logger=logger,
        log_name=log_name,
        input=input,
        watchdog=watchdog,
    )
    return handle  # type: ignore[return-value]


def broadcast(
    tensor: torch.Tensor,
    *,
    group_src: int,
    group: Group | None = None,
    async_op: bool = False,
    logger: CommsLogger | None = None,
    log_name: str | None = None,
    watchdog: CommWatchdog | None = None,
) -> CommHandle[torch.Tensor]:
    """Copy `tensor` from group rank `group_src` to every rank of the group, in place.

    Args:
        tensor: Source on `group_src`, destination elsewhere (same shape and dtype everywhere).
        group_src: The sending rank's index *within the group* (not its global rank).
        group: A ProcessGroup or a 1-D DeviceMesh; the default (world) group when `None`.
        async_op: Return before completion.
        logger: Records the call.
        log_name: Name in the logger; `"broadcast"` when `None`.
        watchdog: Bounds the wait and reports a hang; the logger's watchdog when `None`.

    Returns:
        A handle whose `wait()` returns `tensor`.

    Raises:
        CommError: On a bad group or a `group_src` outside the group.
    """
    pg = resolve_group(group)
    if not 0 <= group_src < pg.size():
        raise CommError(
            f"broadcast group_src={group_src} is outside the group of size {pg.size()}; pass a "
            "rank within the group (0 .. size-1), not a global rank."
        )
    src = dist.get_global_rank(pg, group_src)
    handle = issue(
        "broadcast",
        pg=pg,
        launch=lambda a: dist.broadcast(tensor, src=src, group=pg, async_op=a),
        output=tensor,
        msg_bytes=_nbytes(tensor),
        device=tensor.device,
        async_op=async_op,
        logger=logger,
        log_name=log_name,
        input=tensor,
        watchdog=watchdog,
    )
    return handle  # type: ignore[return-value]


def barrier(
    *,
    group: Group | None = None,
    device_ids: Sequence[int] | None = None,
    async_op: bool = False,
    logger: CommsLogger | None = None,
    log_name: str | None = None,
    watchdog: CommWatchdog | None = None,
) -> CommHandle[None]:
    """Block until every rank of the group has reached the barrier.

    Args:
        group: A ProcessGroup or a 1-D DeviceMesh; the default (world) group when `None`.
        device_ids: Devices the barrier runs on; forwarded to nccl, which takes them, and dropped
            for other backends (gloo), which have no such notion.
        async_op: Return before completion.
        logger: Records the call (0 bytes).
        log_name: Name in the logger; `"barrier"` when `None`.
        watchdog: Bounds the wait and reports a hang; the logger's watchdog when `None`.

    Returns:
        A handle whose `wait()` returns `None`.
    """
    pg = resolve_group(group)
    ids = barrier_device_ids(dist.get_backend(pg), device_ids)
    handle = issue(
        "barrier",
        pg=pg,
        launch=lambda a: dist.barrier(group=pg, async_op=a, device_ids=ids),
        output=None,
        msg_bytes=0,
        device=torch.device("cuda", ids[0]) if ids else None,
        async_op=async_op,
        logger=logger,
        log_name=log_name,
        input=None,
        watchdog=watchdog,
    )
    return handle  # type: ignore[return-value]
