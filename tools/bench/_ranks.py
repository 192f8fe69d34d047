"""Running one bench row on its rank processes: start, wait with a deadline, collect.

Every multi-rank bench (`zero.py`, `checkpoint.py`, `autotp.py`, `sequence_parallel.py`) runs
a row the same way: one process per rank from a ``multiprocessing`` context, each given its own
job (a dataclass with at least ``rank`` and ``out``, the path its worker writes its JSON report
to, and its log beside it as ``out + ".log"``). A row gets one deadline for all its ranks; a
rank still alive then is killed, so a hung collective never hangs the bench. What a failed
rank means is the bench's choice: `reports_or_errors` turns it into an error row (the table
prints it and the bench goes on), `raise_with_logs` stops the bench showing each rank's log.

`verdict` is the one wording of a lower-is-better target that the benches print, and
`free_port` the rendezvous port for a row whose workers use a TCP store.
"""

from __future__ import annotations

import json
import socket
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

__all__ = ["free_port", "raise_with_logs", "reports_or_errors", "run_ranks", "verdict"]


class Job(Protocol):
    """What a rank's job must say: its rank and where its report goes."""

    @property
    def rank(self) -> int: ...

    @property
    def out(self) -> str: ...


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def run_ranks(
    ctx: Any, target: Callable[[Any], None], jobs: Sequence[Job], timeout_s: float
) -> list[int | None]:
    """Run ``target(job)`` in one process per job; returns their exit codes, in job order.

    All ranks share one deadline, ``timeout_s`` from the start; a rank alive at the deadline is
    killed (its exit code is then the kill's, never 0).
    """
    processes = [ctx.Process(target=target, args=(job,)) for job in jobs]
    for process in processes:
        process.start()
    deadline = time.monotonic() + timeout_s
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))
        if process.is_alive():
            process.kill()
            process.join()
    return [process.exitcode for process in processes]


def reports_or_errors(jobs: Sequence[Job], exitcodes: Sequence[int | None]) -> list[dict[str, Any]]:
    """Each rank's report, or ``{"error": ...}`` for a rank that wrote none."""
    reports = []
    for job, code in zip(jobs, exitcodes, strict=True):
        path = Path(job.out)
        if path.exists():
            reports.append(json.loads(path.read_text()))
        else:
            reports.append({"error": f"rank {job.rank} exited with {code}"})
    return reports


def raise_with_logs(
    name: str, jobs: Sequence[Job], exitcodes: Sequence[int | None], tail: int | None = None
) -> None:
    """Raise ``RuntimeError`` after printing every rank's log when a rank did not exit 0.

    Args:
        name: The row, for the messages.
        jobs: The ranks' jobs.
        exitcodes: `run_ranks`'s result.
        tail: Print only the last ``tail`` characters of each log (all of it when None).
    """
    failed = [code for code in exitcodes if code != 0]
    if not failed:
        return
    for job in jobs:
        log = Path(job.out + ".log")
        text = log.read_text(errors="replace") if log.exists() else "(no output)"
        text = text if tail is None else text[-tail:]
        print(f"----- {name} rank {job.rank} output -----\n{text}", file=sys.stderr)
    raise RuntimeError(f"{name}: a rank exited with {failed} (its output is above)")


def verdict(ratio: float, target: float | None) -> str:
    """``(target <= T): MET`` / ``MISSED by D`` for a lower-is-better ratio, or ``(no target)``."""
    if target is None:
        return "(no target)"
    outcome = "MET" if ratio <= target else f"MISSED by {ratio - target:.3f}"
    return f"(target <= {target}): {outcome}"
