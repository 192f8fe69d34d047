"""The two ways a `deepshard.testing.run_on_mesh` run can fail.

Both subclass `AssertionError`: they are test failures, reported by pytest as such, and
never raised by library code (so they live here, not in ``deepshard.interface.errors``).
"""

from __future__ import annotations

__all__ = ["MeshTimeoutError", "RankFailedError"]


class RankFailedError(AssertionError):
    """A rank raised, or its process died without reporting a result.

    Attributes:
        rank: The global rank that failed first.
        exitcode: The process exit code, or ``None`` if the rank reported an exception.
        child_traceback: The formatted traceback from inside the rank, or ``None`` if the process
            died without one (segfault, ``os._exit``, killed by a signal).
    """

    def __init__(self, rank: int, *, exitcode: int | None, child_traceback: str | None) -> None:
        self.rank = rank
        self.exitcode = exitcode
        self.child_traceback = child_traceback
        if child_traceback is not None:
            message = f"rank {rank} raised:\n{child_traceback.rstrip()}"
        else:
            message = (
                f"rank {rank} exited with code {exitcode} without reporting a result "
                "(crashed, was killed, or called os._exit); its output is printed above"
            )
        super().__init__(message)


class RendezvousFailedError(RankFailedError):
    """Gloo failed to connect the ranks while creating the default group.

    Raised only before the test body ran on any rank, so `run_on_mesh` may start the run again.
    """


class MeshTimeoutError(AssertionError):
    """Some ranks did not finish within the run's time limit.

    Attributes:
        ranks: The global ranks that had not reported when time ran out.
        timeout_s: The limit that was exceeded, in seconds.
    """

    def __init__(self, ranks: list[int], timeout_s: float) -> None:
        self.ranks = ranks
        self.timeout_s = timeout_s
        super().__init__(
            f"ranks {ranks} did not finish within {timeout_s:g} s; all ranks were terminated. "
            "Look for a collective that not every rank reaches, or raise timeout_s"
        )
