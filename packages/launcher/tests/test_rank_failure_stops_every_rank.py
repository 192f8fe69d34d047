"""One rank fails or ds-launch is signalled: every rank and grandchild is gone, the code is right.

Every rank starts a grandchild and writes both pids; after ds-launch returns, the process table
must hold none of them (a zombie, an exited orphan waiting for init to reap it, counts as gone).
"""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

import pytest

from deepshard.testing import import_beside

_probes = import_beside(__file__, "_probes.py")
STOP_WITHIN_S = 5.0


def _start(tmp_path: Path, nproc: int, **env: str) -> tuple[subprocess.Popen[bytes], Path]:
    out = tmp_path / "out"
    out.mkdir()
    (tmp_path / "failing.py").write_text(_probes.FAILING)
    with (tmp_path / "stdout").open("wb") as stdout, (tmp_path / "stderr").open("wb") as stderr:
        launcher = subprocess.Popen(
            [*_probes.DS_LAUNCH, "--nproc_per_node", str(nproc), "failing.py", "out"],
            cwd=tmp_path,
            env=_probes.launcher_env(**env),
            stdout=stdout,
            stderr=stderr,
        )
    return launcher, out


def _wait(launcher: subprocess.Popen[bytes], timeout: float) -> int:
    try:
        return launcher.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        launcher.kill()
        launcher.wait()
        raise


def _assert_all_gone(out: Path, within: float = 0.0) -> None:
    pids = _probes.recorded_pids(out)
    assert len(pids) >= 2
    deadline = time.monotonic() + within
    while any(_probes.process_running(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [pid for pid in pids if _probes.process_running(pid)] == []


@pytest.mark.slow
@pytest.mark.parametrize(
    ("how", "code", "words"),
    [
        ("3", 3, "rank 1 (local rank 1 on localhost) exited with code 3"),
        ("kill", 137, "rank 1 (local rank 1 on localhost) was killed by SIGKILL (exit code 137)"),
    ],
    ids=["exit-3", "sigkill"],
)
def test_a_failed_rank_stops_the_others_and_sets_the_code(
    tmp_path: Path, how: str, code: int, words: str
) -> None:
    # The surviving ranks ignore SIGTERM, so only the SIGKILL after the grace period stops them.
    launcher, out = _start(tmp_path, 3, FAIL_HOW=how, IGNORE_TERM="1")
    _probes.wait_for_files(out, "pids*", 3)
    ready = time.monotonic()
    assert _wait(launcher, timeout=60) == code
    assert time.monotonic() - ready < STOP_WITHIN_S
    _assert_all_gone(out)
    stderr = (tmp_path / "stderr").read_text()
    assert f"ds-launch: {words}; the other processes were stopped" in stderr
    assert "    about to fail: the last words" in stderr  # the tail of the failed rank's output
    assert "[rank 1] about to fail: the last words" in (tmp_path / "stdout").read_text()


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_to_ds_launch_reaches_every_rank(tmp_path: Path, signum: int) -> None:
    launcher, out = _start(tmp_path, 2, FAIL_RANK="-1", FAIL_HOW="0")
    _probes.wait_for_files(out, "pids*", 2)
    launcher.send_signal(signum)
    assert _wait(launcher, timeout=STOP_WITHIN_S + 5) == 128 + signum
    _assert_all_gone(out)
    name = signal.Signals(signum).name
    assert f"ds-launch: received {name}; stopped every process" in (tmp_path / "stderr").read_text()
    if signum == signal.SIGINT:  # the ranks got SIGINT itself: Python raised KeyboardInterrupt
        stderr = (tmp_path / "stderr").read_text()
        for rank in (0, 1):
            assert f"[rank {rank}] KeyboardInterrupt" in stderr, stderr


@pytest.mark.slow
def test_killing_ds_launch_outright_leaves_nothing_behind(tmp_path: Path) -> None:
    launcher, out = _start(tmp_path, 2, FAIL_RANK="-1", FAIL_HOW="0")
    _probes.wait_for_files(out, "pids*", 2)
    launcher.kill()  # SIGKILL: ds-launch cannot clean up; the kernel and its watchdog do
    launcher.wait()
    _assert_all_gone(out, within=STOP_WITHIN_S)
