"""Helper threads that hash a chunk while the writer writes it.

They are started by `save` on the caller's thread and handed to the writer, never started by
the writer itself: a background save may still be writing while the interpreter exits (process
exit waits for it), and by then neither ``concurrent.futures`` (shut down before ``atexit``
handlers run) nor, on newer Pythons, a new thread is available.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["HashThreads"]

_Call = tuple[Callable[[Any], None], Any, threading.Event, list[BaseException]]


class HashThreads:
    """A fixed set of daemon threads, each running one call at a time from its own queue."""

    def __init__(self, count: int = 2) -> None:
        self._queues: list[queue.SimpleQueue[_Call | None]] = []
        for index in range(count):
            jobs: queue.SimpleQueue[_Call | None] = queue.SimpleQueue()
            name = f"deepshard-checkpoint-hash-{index}"
            threading.Thread(target=_serve, args=(jobs,), name=name, daemon=True).start()
            self._queues.append(jobs)

    def start(self, calls: Sequence[tuple[Callable[[Any], None], Any]]) -> Callable[[], None]:
        """Start ``fn(arg)`` for each call on its own thread; return a function that waits.

        The waiting function re-raises the first error a call raised.
        """
        if len(calls) > len(self._queues):
            raise ValueError(f"{len(calls)} calls for {len(self._queues)} hash threads")
        pending = []
        for (fn, arg), jobs in zip(calls, self._queues, strict=False):
            done, errors = threading.Event(), list[BaseException]()
            jobs.put((fn, arg, done, errors))
            pending.append((done, errors))

        def wait() -> None:
            for done, errors in pending:
                done.wait()
                if errors:
                    raise errors[0]

        return wait

    def close(self) -> None:
        """Let the threads end once idle."""
        for jobs in self._queues:
            jobs.put(None)


def _serve(jobs: queue.SimpleQueue[_Call | None]) -> None:
    while (job := jobs.get()) is not None:
        fn, arg, done, errors = job
        try:
            fn(arg)
        except BaseException as exc:
            errors.append(exc)
        done.set()
