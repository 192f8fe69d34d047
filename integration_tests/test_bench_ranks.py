"""``tools/bench/_ranks.py``: a bench row's rank processes, their deadline and their reports.

Real processes (the ``fork`` context, so the targets need not be importable): a rank that
reports, one that fails without a report, one that hangs past the deadline and is killed.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools" / "bench"))
import _ranks  # (the bench's modules import each other by bare name)


@dataclass(frozen=True)
class Job:
    rank: int
    out: str
    behaviour: str


def _rank(job: Job) -> None:
    Path(job.out + ".log").write_text(f"rank {job.rank} says {job.behaviour}\n")
    if job.behaviour == "hang":
        time.sleep(120)
    if job.behaviour == "fail":
        os._exit(3)
    Path(job.out).write_text(json.dumps({"rank": job.rank}))


def _jobs(tmp_path: Path, *behaviours: str) -> list[Job]:
    return [Job(i, str(tmp_path / f"r{i}.json"), b) for i, b in enumerate(behaviours)]


@pytest.fixture
def ctx() -> multiprocessing.context.BaseContext:
    if "fork" not in multiprocessing.get_all_start_methods():
        pytest.skip("needs the fork start method")
    return multiprocessing.get_context("fork")


def test_every_rank_reports(tmp_path: Path, ctx: multiprocessing.context.BaseContext) -> None:
    jobs = _jobs(tmp_path, "ok", "ok")
    codes = _ranks.run_ranks(ctx, _rank, jobs, timeout_s=60)
    assert codes == [0, 0]
    assert _ranks.reports_or_errors(jobs, codes) == [{"rank": 0}, {"rank": 1}]
    _ranks.raise_with_logs("row", jobs, codes)  # nothing failed: no error


def test_a_hung_rank_is_killed_at_the_deadline(
    tmp_path: Path, ctx: multiprocessing.context.BaseContext
) -> None:
    jobs = _jobs(tmp_path, "ok", "hang")
    start = time.monotonic()
    codes = _ranks.run_ranks(ctx, _rank, jobs, timeout_s=3)
    assert time.monotonic() - start < 60
    assert codes[0] == 0 and codes[1] not in (0, None)
    reports = _ranks.reports_or_errors(jobs, codes)
    assert reports[0] == {"rank": 0}
    assert reports[1] == {"error": f"rank 1 exited with {codes[1]}"}


def test_a_failed_rank_stops_the_bench_showing_every_log(
    tmp_path: Path, ctx: multiprocessing.context.BaseContext, capsys: pytest.CaptureFixture[str]
) -> None:
    jobs = _jobs(tmp_path, "fail", "ok")
    codes = _ranks.run_ranks(ctx, _rank, jobs, timeout_s=60)
    assert codes == [3, 0]
    with pytest.raises(RuntimeError, match=r"row: a rank exited with \[3\]"):
        _ranks.raise_with_logs("row", jobs, codes, tail=9)
    err = capsys.readouterr().err
    assert "----- row rank 0 output -----\nays fail\n" in err  # the last 9 characters of its log
    assert "----- row rank 1 output -----" in err


def test_the_verdict_wording() -> None:
    assert _ranks.verdict(0.9, 1.0) == "(target <= 1.0): MET"
    assert _ranks.verdict(1.25, 1.0) == "(target <= 1.0): MISSED by 0.250"
    assert _ranks.verdict(3.0, None) == "(no target)"


def test_a_free_port_can_be_bound() -> None:
    import socket

    port = _ranks.free_port()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))
