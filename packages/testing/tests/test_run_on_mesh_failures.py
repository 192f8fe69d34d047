"""run_on_mesh: a failing, dying or hanging rank fails the call and no rank outlives it."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from deepshard.testing import MeshTimeoutError, RankFailedError, run_on_mesh


def _record_pid(pid_dir: str, rank: int) -> None:
    Path(pid_dir, f"{rank}.pid").write_text(str(os.getpid()))
    dist.barrier()  # every pid is on disk before any rank misbehaves


def _raise_on_rank_1(mesh: object, pid_dir: str) -> None:
    rank = mesh.get_rank()  # type: ignore[attr-defined]
    _record_pid(pid_dir, rank)
    if rank == 1:
        raise ValueError("boom from rank 1")
    dist.barrier()  # never completes: rank 1 does not get here


def _exit_on_rank_1(mesh: object, pid_dir: str) -> None:
    rank = mesh.get_rank()  # type: ignore[attr-defined]
    _record_pid(pid_dir, rank)
    if rank == 1:
        os._exit(7)
    dist.barrier()


def _hang_on_rank_0(mesh: object, pid_dir: str) -> int:
    rank = mesh.get_rank()  # type: ignore[attr-defined]
    _record_pid(pid_dir, rank)
    if rank == 0:
        time.sleep(600)
    return rank


def _assert_all_gone(pid_dir: Path, world_size: int) -> None:
    pids = [int(pid_dir.joinpath(f"{rank}.pid").read_text()) for rank in range(world_size)]
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_raising_rank_is_reported_and_the_others_are_stopped(tmp_path: Path) -> None:
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    start = time.monotonic()
    with pytest.raises(RankFailedError) as caught:
        run_on_mesh(_raise_on_rank_1, 4, args=(str(pid_dir),), timeout_s=60, store_dir=tmp_path)
    assert time.monotonic() - start < 20  # not the 60 s timeout: rank 1's report stopped the run
    error = caught.value
    assert error.rank == 1
    assert error.exitcode is None
    assert error.child_traceback is not None
    assert "ValueError: boom from rank 1" in error.child_traceback
    assert "_raise_on_rank_1" in error.child_traceback
    assert "rank 1 raised" in str(error)
    _assert_all_gone(pid_dir, 4)


def test_rank_dying_without_a_report_is_detected(tmp_path: Path) -> None:
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    with pytest.raises(RankFailedError) as caught:
        run_on_mesh(_exit_on_rank_1, 2, args=(str(pid_dir),), timeout_s=60, store_dir=tmp_path)
    assert caught.value.rank == 1
    assert caught.value.exitcode == 7
    assert caught.value.child_traceback is None
    assert "exited with code 7" in str(caught.value)
    _assert_all_gone(pid_dir, 2)


@pytest.mark.slow  # over 4 s (subprocesses / a deliberate hang); the main run has it
def test_timeout_names_the_unfinished_ranks(tmp_path: Path) -> None:
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    start = time.monotonic()
    with pytest.raises(MeshTimeoutError) as caught:
        run_on_mesh(_hang_on_rank_0, 2, args=(str(pid_dir),), timeout_s=1.0, store_dir=tmp_path)
    assert time.monotonic() - start < 15
    assert caught.value.ranks == [0]
    assert "ranks [0] did not finish" in str(caught.value)
    _assert_all_gone(pid_dir, 2)
