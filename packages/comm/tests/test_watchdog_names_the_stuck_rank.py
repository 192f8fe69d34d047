"""Rank 1 sleeps while rank 0 waits in an all_reduce: rank 0 names rank 1 and fails in time.

Rank 0's watchdog time is 2.5 s; rank 1 sleeps 5.5 s, long past it. Rank 0 must raise `CommError`
within the watchdog time plus the grace for answers (and a margin for a loaded machine), and the
report must name rank 1 as not arrived, the op with its shape and dtype, rank 0's call site (the
line found here with `inspect`), and where rank 1 is: its last collective and its sleeping frame.
"""

from __future__ import annotations

import inspect
import time
from typing import Any

import pytest
import torch

import deepshard.comm as comm
from deepshard.interface.errors import CommError
from deepshard.interface.watchdog import parse_watchdog_line

WATCHDOG_S = 2.5
SLEEP_S = 5.5
MARGIN_S = 1.5


def _waiting_step(group: Any, dog: comm.CommWatchdog) -> None:
    comm.all_reduce(torch.ones(4, 2), group=group, watchdog=dog)


def _one_rank_sleeps(mesh: Any) -> dict[str, Any]:
    rank, group = mesh.get_rank(), mesh["dp"]
    dog = comm.CommWatchdog(WATCHDOG_S)  # the default group's store and rank
    comm.all_reduce(torch.ones(3), group=group, watchdog=dog)  # both ranks pass #1
    if rank == 1:
        time.sleep(SLEEP_S)  # the stuck rank
        # Joins the all_reduce rank 0 gave up on (still queued in gloo), so both ranks end.
        comm.all_reduce(torch.ones(4, 2), group=group, watchdog=dog)
        dog.close()
        return {}
    start = time.monotonic()
    try:
        _waiting_step(group, dog)
    except CommError as error:
        return {"error": str(error), "elapsed": time.monotonic() - start, "grace": dog.grace_s}
    finally:
        dog.close()
    return {"error": None, "elapsed": time.monotonic() - start}


@pytest.mark.slow  # over 4 s (subprocesses / a deliberate hang); the main run has it
def test_the_waiting_rank_names_the_sleeping_one_and_fails(run_on_mesh: Any) -> None:
    waiting, _ = run_on_mesh(_one_rank_sleeps, 2, timeout_s=60)
    report = waiting["error"]
    assert report is not None, "rank 0 did not fail while rank 1 slept"
    assert WATCHDOG_S <= waiting["elapsed"] <= WATCHDOG_S + waiting["grace"] + MARGIN_S

    summary = parse_watchdog_line(report.splitlines()[0])
    assert summary is not None, report
    assert (summary.rank, summary.stuck) == (0, (1,))
    assert "all_reduce #2 (float32[4, 2])" in summary.what
    call_line = first_line_of(_waiting_step, "comm.all_reduce")
    assert f"test_watchdog_names_the_stuck_rank.py:{call_line} in _waiting_step" in summary.what

    rank1 = next(line for line in report.splitlines() if line.startswith("  rank 1 behind:"))
    assert "last here: all_reduce #1 (float32[3])" in rank1 and "completed" in rank1
    sleep_line = first_line_of(_one_rank_sleeps, "time.sleep(SLEEP_S)")
    assert f":{sleep_line} in _one_rank_sleeps: time.sleep(SLEEP_S)" in rank1
    assert "DEEPSHARD_WATCHDOG_S" in report


def first_line_of(fn: Any, text: str) -> int:
    lines, first = inspect.getsourcelines(fn)
    return first + next(i for i, line in enumerate(lines) if text in line)
