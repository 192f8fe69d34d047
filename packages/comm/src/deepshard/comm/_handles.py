"""The handle every collective returns: a wait you may repeat, and the output it yields.

`torch.distributed` returns a `Work` for an async call and `None` for a sync one, and what a
caller may do after `Work.wait()` differs by backend. DeepShard's collectives always return a
`CommHandle`, so calling code is the same for both: `wait()` blocks until the collective
is done, runs the follow-up step once (e.g. the division of an emulated average, or stopping the
comms logger's clock), and returns the output tensor. Calling `wait()` again only returns the
output.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

import torch.distributed as dist

__all__ = ["CommHandle"]

T = TypeVar("T")


class CommHandle(Generic[T]):
    """The result of one collective; `wait()` completes it and returns the output.

    Sync calls return a handle that is already complete. `wait()` is idempotent: the first call
    waits on the backend and runs the follow-up step, later calls return the same output.

    Args:
        output: What `wait()` returns: the output tensor (`None` for `barrier`).
        work: The backend's pending work for an async call; `None` when already complete.
        on_complete: Run once, right after the backend completes (also for sync calls, where it
            runs before the handle is returned). If it raises, the error propagates and the
            handle stays pending: the next `wait()` runs it again.
        waiter: Waits for `work` instead of `work.wait()` (the comms watchdog's bounded wait).
    """

    __slots__ = ("_done", "_on_complete", "_output", "_waiter", "_work")

    def __init__(
        self,
        output: T,
        *,
        work: dist.Work | None = None,
        on_complete: Callable[[], None] | None = None,
        waiter: Callable[[dist.Work], None] | None = None,
    ) -> None:
        self._output = output
        self._work = work
        self._waiter = waiter
        self._on_complete = on_complete
        self._done = False
        if work is None:
            self._complete()

    def wait(self) -> T:
        """Block until the collective is done and return its output (repeatable).

        Returns:
            The output tensor (for in-place collectives, the input tensor itself), or `None` for
            a barrier.
        """
        if not self._done:
            if self._work is not None:
                if self._waiter is not None:
                    self._waiter(self._work)
                else:
                    self._work.wait()
            self._complete()
        return self._output

    def is_completed(self) -> bool:
        """Whether `wait()` has already finished, i.e. the output may be read.

        A `True` from the backend alone is not enough: the follow-up step runs in `wait()`.
        """
        return self._done

    def _complete(self) -> None:
        # The backend is done; only the follow-up is left. If it raises, the handle stays
        # pending and the next wait() runs it again instead of returning an unfinished output.
        self._work = None
        if self._on_complete is not None:
            self._on_complete()
            self._on_complete = None
        self._done = True

    def __repr__(self) -> str:
        state = "completed" if self._done else "pending"
        return f"CommHandle({state})"
