"""What a remote node runs, run here: the ssh command string through ``bash -c``, its stop
protocol on stdin, pdsh's ``--stop_job``, and whole multi-node jobs through a stand-in ssh.

The stand-in ``ssh`` (a shell script first on ``PATH``) drops the options and the host and runs
the command string with ``bash -c`` in an emptied environment, as a login on another host
would: what reaches the ranks is only what the command string itself carries. Its stdin is
ds-launch's pipe, as with the real ssh client. (Real ssh is covered by test_ssh_backend_real.py.)
"""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from deepshard.launcher import LaunchOptions, RunOptions, plan_launch
from deepshard.testing import import_beside

_probes = import_beside(__file__, "_probes.py")
PAYLOAD = "a b'; touch pwned; '\"; touch pwned; \"$(touch pwned)`touch pwned` * $HOME\nz"
TWO_NODES = "localhost slots=1\n127.0.0.1 slots=2\n"
FAKE_SSH = """#!/bin/sh
# Stand-in for ssh: the last argument is the remote command; run it like a fresh login would.
for last in "$@"; do :; done
exec env -i PATH=/usr/bin:/bin HOME="$HOME" /bin/bash -c "$last"
"""


def _login_env(home: Path) -> dict[str, str]:
    return {"PATH": "/usr/bin:/bin", "HOME": str(home)}


def _remote_commands(job: Path, script: str, *args: str, **environ: str) -> list[str]:
    (job / "hostfile").write_text(TWO_NODES)
    plan = plan_launch(
        LaunchOptions(
            run=RunOptions(script=script, script_args=args),
            hostfile=str(job / "hostfile"),
            launcher="ssh",
        ),
        environ={**_probes.launcher_env(), **environ},
        cwd=str(job),
        home=str(job / "home"),
        python=sys.executable,
    )
    return [spec.argv[-1] for spec in plan.specs]


def _pwned(*places: Path) -> list[Path]:
    return [found for place in places for found in place.glob("pwned*")]


@pytest.mark.slow
def test_remote_command_delivers_env_and_arguments_verbatim(tmp_path: Path) -> None:
    job, elsewhere = tmp_path / "job", tmp_path / "elsewhere"
    for directory in (job, job / "out", elsewhere):
        directory.mkdir()
    (job / "probe.py").write_text(_probes.PROBE)
    commands = _remote_commands(job, "probe.py", "out", PAYLOAD, "--plain", DEEPSHARD_PROBE=PAYLOAD)
    for command in commands:
        # The node entry watches stdin: keep it open until the node is done.
        node = subprocess.Popen(
            ["bash", "-c", command], cwd=elsewhere, env=_login_env(tmp_path), stdin=subprocess.PIPE
        )
        assert node.wait(timeout=60) == 0
        node.stdin.close()  # type: ignore[union-attr]
    records = _probes.records(job / "out")
    assert [r["env"]["CROSS_RANK"] for r in records] == ["0", "1", "1"]
    for record in records:
        assert record["env"]["DEEPSHARD_PROBE"] == PAYLOAD
        assert record["argv"][:3] == ["out", PAYLOAD, "--plain"]
        assert record["cwd"] == str(job)  # the node changed to the launch directory
        assert record["env"]["OMP_NUM_THREADS"] == "1"  # OMP_* travels with the job
    assert _pwned(job, job / "out", elsewhere, tmp_path) == []


@pytest.mark.slow
@pytest.mark.parametrize(
    ("message", "code"), [(b"stop 2\n", 130), (b"", 143)], ids=["stop-2", "eof"]
)
def test_node_entry_stops_on_its_stdin(tmp_path: Path, message: bytes, code: int) -> None:
    (tmp_path / "out").mkdir()
    (tmp_path / "failing.py").write_text(_probes.FAILING)
    command = _remote_commands(tmp_path, "failing.py", "out", FAIL_RANK="-1", FAIL_HOW="0")[1]
    node = subprocess.Popen(
        ["bash", "-c", command],
        env=_login_env(tmp_path),
        stdin=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    _probes.wait_for_files(tmp_path / "out", "pids*", 2)
    node.stdin.write(message)  # type: ignore[union-attr]
    node.stdin.close()  # type: ignore[union-attr]
    assert node.wait(timeout=10) == code
    pids = _probes.recorded_pids(tmp_path / "out")
    assert [pid for pid in pids if _probes.process_running(pid)] == []
    if code == 130:
        assert b"KeyboardInterrupt" in node.stderr.read()  # type: ignore[union-attr]


@pytest.mark.slow
def test_stop_job_signals_the_node_entries_of_that_job(tmp_path: Path) -> None:
    (tmp_path / "out").mkdir()
    (tmp_path / "failing.py").write_text(_probes.FAILING)
    command = _remote_commands(tmp_path, "failing.py", "out", FAIL_RANK="-1", FAIL_HOW="0")[1]
    command = command.replace("--watch_stdin", "--job_id=test-job-1")
    node = subprocess.Popen(["bash", "-c", command], env=_login_env(tmp_path))
    _probes.wait_for_files(tmp_path / "out", "pids*", 2)
    stop = [sys.executable, "-m", "deepshard.launcher.node", "--stop_job=test-job-1", "--signal=15"]
    assert subprocess.run(stop, timeout=30, check=False).returncode == 0
    assert node.wait(timeout=10) == 143
    pids = _probes.recorded_pids(tmp_path / "out")
    assert [pid for pid in pids if _probes.process_running(pid)] == []


def _fake_ssh_env(tmp_path: Path, **remote: str) -> dict[str, str]:
    """ds-launch's environment with the stand-in ssh; ``remote`` goes through .deepshard_env."""
    (tmp_path / ".deepshard_env").write_text("".join(f"{k}={v}\n" for k, v in remote.items()))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    ssh = bin_dir / "ssh"
    ssh.write_text(FAKE_SSH)
    ssh.chmod(ssh.stat().st_mode | stat.S_IXUSR)
    env = _probes.launcher_env()
    env["PATH"] = f"{bin_dir}{os.pathsep}{env['PATH']}"
    return env


@pytest.mark.slow
def test_a_failure_on_one_node_stops_every_node(tmp_path: Path) -> None:
    (tmp_path / "out").mkdir()
    (tmp_path / "failing.py").write_text(_probes.FAILING)
    (tmp_path / "hostfile").write_text(TWO_NODES)
    env = _fake_ssh_env(tmp_path, FAIL_RANK="2", FAIL_HOW="3")
    done = _probes.ds_launch(
        "-H",
        "hostfile",
        "--launcher",
        "ssh",
        "--ssh_port",
        "2222",
        "failing.py",
        "out",
        cwd=tmp_path,
        env=env,
    )
    assert done.returncode == 3, done.stderr
    assert len(list((tmp_path / "out").glob("pids*"))) == 3
    pids = _probes.recorded_pids(tmp_path / "out")
    assert [pid for pid in pids if _probes.process_running(pid)] == []
    # The node entry names the rank; the launcher names the node, without repeating the tail.
    assert "ds-launch: rank 2 (local rank 1 on 127.0.0.1) exited with code 3" in done.stderr
    assert "ds-launch: node 1 (127.0.0.1, over ssh) exited with code 3" in done.stderr
    assert done.stderr.count("about to fail: the last words") == 1  # in the node's report only
    assert "[rank 2] about to fail: the last words" in done.stdout  # streamed from the node


@pytest.mark.slow
def test_ctrl_c_reaches_the_ranks_of_every_node(tmp_path: Path) -> None:
    (tmp_path / "out").mkdir()
    (tmp_path / "failing.py").write_text(_probes.FAILING)
    (tmp_path / "hostfile").write_text(TWO_NODES)
    env = _fake_ssh_env(tmp_path, FAIL_RANK="-1", FAIL_HOW="0")
    launcher = subprocess.Popen(
        [*_probes.DS_LAUNCH, "-H", "hostfile", "--launcher", "ssh", "failing.py", "out"],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    _probes.wait_for_files(tmp_path / "out", "pids*", 3)
    start = time.monotonic()
    launcher.send_signal(signal.SIGINT)
    _, stderr = launcher.communicate(timeout=30)
    assert launcher.returncode == 130, stderr
    assert time.monotonic() - start < 5
    pids = _probes.recorded_pids(tmp_path / "out")
    assert [pid for pid in pids if _probes.process_running(pid)] == []
    for rank in (0, 1, 2):
        assert f"[rank {rank}] KeyboardInterrupt" in stderr, stderr


# Ranks 1 and 2 (both on node 1) raise the same ConfigError; they ignore SIGTERM so that the first
# failure does not stop the other before it raised. Rank 0 waits to be stopped.
CONFIG_ERROR = """\
import os, signal, time
if os.environ["RANK"] == "0":
    time.sleep(120)
signal.signal(signal.SIGTERM, signal.SIG_IGN)
from deepshard.interface.errors import ConfigError
raise ConfigError("train_batch_size: must be divisible by 3 ranks")
"""


@pytest.mark.slow
def test_a_remote_node_reports_its_ranks_config_error_once(tmp_path: Path) -> None:
    (tmp_path / "bad.py").write_text(CONFIG_ERROR)
    (tmp_path / "hostfile").write_text(TWO_NODES)
    done = _probes.ds_launch(
        "-H", "hostfile", "--launcher", "ssh", "bad.py", cwd=tmp_path, env=_fake_ssh_env(tmp_path)
    )
    console = done.stdout + done.stderr
    assert done.returncode == 1, console
    assert console.count("train_batch_size: must be divisible by 3 ranks") == 1, console
    assert "Traceback" not in console
    assert "ds-launch: ranks 1, 2 stopped with ConfigError:" in done.stderr
    assert "ds-launch: node 1 (127.0.0.1, over ssh) exited with code 1" in done.stderr
