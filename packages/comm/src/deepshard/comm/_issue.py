"""Launching one collective: the logger's clock, the watchdog's record, the backend call, and
the handle around it."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from deepshard.comm._groups import check_avg_dtype, has_native_avg
from deepshard.comm._handles import CommHandle
from deepshard.comm.logger import CommsLogger, CommTiming
from deepshard.comm.watchdog import CommWatchdog
from deepshard.interface.errors import CommError

__all__ = ["flat_view", "issue", "plan_reduction"]

_Launch = Callable[[bool], "dist.Work | None"]


def issue(
    op_name: str,
    *,
    pg: dist.ProcessGroup,
    launch: _Launch,
    output: torch.Tensor | None,
    msg_bytes: int,
    device: torch.device | None,
    async_op: bool,
    logger: CommsLogger | None,
    log_name: str | None,
    after: Callable[[], None] | None = None,
    input: torch.Tensor | None = None,
    watchdog: CommWatchdog | None = None,
) -> CommHandle[torch.Tensor | None]:
    """Time (if logged), launch, and wrap one collective in a handle.

    The logger's clock stops when the backend completes the call (an async call's future), not
    when the caller gets round to `wait()`, and before the follow-up step `after` runs.

    With a watchdog (`watchdog`, else the logger's), the call is recorded with its `input`
    and always launched async, so that every wait, sync or not, is bounded by the watchdog.
    """
    timing = None
    if logger is not None:
        timing = logger.start(
            op_name,
            msg_bytes=msg_bytes,
            world_size=pg.size(),
            log_name=log_name,
            device=device,
            group_rank=pg.rank(),
        )
    if watchdog is None and logger is not None:
        watchdog = logger.watchdog
    call = None if watchdog is None else watchdog.begin(op_name, pg, input)
    work = launch(async_op or call is not None)
    done_at = None
    if timing is not None and async_op and work is not None:
        assert logger is not None
        done_at = _completion_time(work, logger.clock, device)
    on_complete = _follow_up(logger, timing, done_at, after)
    if watchdog is None or call is None:
        return CommHandle(output, work=work if async_op else None, on_complete=on_complete)
    if work is None:  # nothing was launched (not a member): nothing to wait for
        call.done = True
        return CommHandle(output, on_complete=on_complete)
    if not async_op:
        watchdog.wait(work, call)
        return CommHandle(output, on_complete=on_complete)
    dog = watchdog
    return CommHandle(
        output, work=work, on_complete=on_complete, waiter=lambda w: dog.wait(w, call)
    )


def _follow_up(
    logger: CommsLogger | None,
    timing: CommTiming | None,
    done_at: torch.futures.Future[float] | None,
    after: Callable[[], None] | None,
) -> Callable[[], None]:
    """What runs once the backend is done: stop the logger's clock, then `after`."""

    def on_complete() -> None:
        if timing is not None:
            assert logger is not None
            logger.stop(timing, end_s=None if done_at is None else done_at.wait())
        if after is not None:
            after()

    return on_complete


def _completion_time(
    work: dist.Work, clock: Callable[[], float], device: torch.device | None
) -> torch.futures.Future[float] | None:
    """A future of the clock's reading when `work` completed, where the backend can tell.

    Only for host (CPU) work: an accelerator backend completes its future when the kernels
    are queued, not run, so there the logger synchronizes at `wait()` instead (`None`).
    """
    if device is not None and device.type != "cpu":
        return None
    try:
        future = work.get_future()
    except (RuntimeError, AttributeError):  # a backend without futures (e.g. mpi)
        return None
    # `then` runs the callback once the work completes; waiting on the chained future also
    # waits for the callback, which may run on the backend's thread after `work.wait()`.
    return future.then(lambda _: clock())


def flat_view(output: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """`output` viewed as `shape`, sharing its memory.

    Raises:
        CommError: If `output` is not contiguous, so no such view exists.
    """
    if not output.is_contiguous():
        raise CommError(
            f"a stacked output of shape {tuple(output.shape)} must be contiguous; pass a "
            "contiguous tensor (e.g. output.contiguous()) or output=None."
        )
    return output.view(shape)


def plan_reduction(
    red: dist.ReduceOp.RedOpType,
    pg: dist.ProcessGroup,
    *,
    input: torch.Tensor,
    output: torch.Tensor,
) -> tuple[dist.ReduceOp.RedOpType, Callable[[], None] | None]:
    """The op to hand the backend and the follow-up that completes it, if any.

    An average on a backend without a native AVG runs as a sum; the follow-up divides `output`
    by the group size once the sum has arrived.

    Raises:
        CommError: `"avg"` of a non-float `input`.
    """
    if red != dist.ReduceOp.AVG:
        return red, None
    check_avg_dtype(input)
    if has_native_avg(pg):
        return red, None
    size = pg.size()

    def divide() -> None:
        output.div_(size)

    return dist.ReduceOp.SUM, divide
