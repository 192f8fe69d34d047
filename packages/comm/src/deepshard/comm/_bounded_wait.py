"""Waiting for a backend's work with a timeout, whether or not the work supports one."""

from __future__ import annotations

import queue
import threading

import torch.distributed as dist

__all__ = ["BlockingWaiter", "honours_timeout"]


def honours_timeout(work: dist.Work) -> bool:
    """Whether `work.wait(timeout)` returns at the timeout.

    A backend's own work does (gloo's raises "Operation timed out!"); the generic wrapper some
    ops return (gloo's `reduce_scatter_tensor`) ignores the timeout and has no future; it is
    waited for on a helper thread instead (about 30 us more per call).
    """
    try:
        work.get_future()
    except RuntimeError:
        return False
    return True


class BlockingWaiter:
    """Runs `work.wait()` on a daemon thread, so that the caller can wait with a timeout.

    For works whose own wait ignores a timeout. The thread starts at the first such wait; a
    hung wait keeps it blocked, but the caller has stopped waiting on it by then.
    """

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def wait(self, work: dist.Work, timeout_s: float) -> bool:
        """Wait for `work` at most `timeout_s`; `False` if it is still pending then.

        Raises:
            RuntimeError: The backend's error, when the work failed.
        """
        if self._thread is None:
            self._thread = threading.Thread(
                target=_run_waits, args=(self._jobs,), name="deepshard-comms-wait", daemon=True
            )
            self._thread.start()
        job = _Job(work)
        self._jobs.put(job)
        if not job.done.wait(timeout_s):
            return False
        if job.error is not None:
            raise job.error
        return True

    def close(self) -> None:
        """End the thread once it is idle."""
        self._jobs.put(None)


class _Job:
    __slots__ = ("done", "error", "work")

    def __init__(self, work: dist.Work) -> None:
        self.work = work
        self.done = threading.Event()
        self.error: RuntimeError | None = None


def _run_waits(jobs: queue.SimpleQueue[_Job | None]) -> None:
    while (job := jobs.get()) is not None:
        try:
            job.work.wait()
        except RuntimeError as error:
            job.error = error
        job.work = None  # type: ignore[assignment]  # release the work and its tensors
        job.done.set()
