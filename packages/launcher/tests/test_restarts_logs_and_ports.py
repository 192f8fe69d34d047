"""--max_restarts restarts the whole group (fresh port if the old one is stuck), --log_dir files,
and a busy --master_port replaced by a free one."""

from __future__ import annotations

import json
import socket
import subprocess
from pathlib import Path

import pytest

from deepshard.testing import import_beside

_probes = import_beside(__file__, "_probes.py")

# Records the attempt; rank 1 fails while DEEPSHARD_RESTART_COUNT < FAIL_UNTIL (after rank 0 has
# recorded the same attempt), and on the first attempt waits for OUT/go first (so the test can
# occupy the port before the restart).
RESTARTING = """\
import json, os, sys, time
from pathlib import Path

out = Path(sys.argv[1])
rank, attempt = os.environ["RANK"], int(os.environ["DEEPSHARD_RESTART_COUNT"])
record = {"port": os.environ["MASTER_PORT"], "attempt": attempt}
(out / f"rank{rank}.restart{attempt}.json").write_text(json.dumps(record))
print(f"rank {rank} attempt {attempt}", flush=True)
if rank == "1" and attempt < int(os.environ["FAIL_UNTIL"]):
    # Fail only once rank 0 has recorded this attempt (else, on a loaded machine, rank 0 can be
    # stopped before it writes, and the test would see a missing record, not a launcher bug).
    deadline = time.monotonic() + 60
    while not (out / f"rank0.restart{attempt}.json").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    while attempt == 0 and os.environ.get("WAIT_FOR_GO") and not (out / "go").exists():
        time.sleep(0.05)
    sys.exit(5)
"""


def _listening_socket() -> socket.socket:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    return server


def _job(tmp_path: Path) -> Path:
    (tmp_path / "out").mkdir()
    (tmp_path / "restarting.py").write_text(RESTARTING)
    return tmp_path


@pytest.mark.slow
def test_restart_after_failure_moves_off_a_stuck_port_and_logs_per_rank(tmp_path: Path) -> None:
    job = _job(tmp_path)
    out, logs = job / "out", job / "logs"
    with socket.socket() as probe:  # a port that is free now, and taken before the restart
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    launcher = subprocess.Popen(
        [
            *_probes.DS_LAUNCH,
            "--nproc_per_node",
            "2",
            "--master_port",
            str(port),
            "--max_restarts",
            "2",
            "--log_dir",
            "logs",
            "restarting.py",
            "out",
        ],
        cwd=job,
        env=_probes.launcher_env(FAIL_UNTIL="1", WAIT_FOR_GO="1"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    _probes.wait_for_files(out, "rank*.restart0.json", 2)
    with socket.socket() as stuck:
        stuck.bind(("127.0.0.1", port))
        stuck.listen()
        (out / "go").touch()
        stdout, stderr = launcher.communicate(timeout=60)
    assert launcher.returncode == 0, stderr
    first = [json.loads((out / f"rank{r}.restart0.json").read_text()) for r in (0, 1)]
    second = [json.loads((out / f"rank{r}.restart1.json").read_text()) for r in (0, 1)]
    assert {r["port"] for r in first} == {str(port)}
    assert len({r["port"] for r in second}) == 1 and second[0]["port"] != str(port)
    assert not list(out.glob("*.restart2.json"))  # the second attempt succeeded: no third
    assert "restarting the job (restart 1 of 2, DEEPSHARD_RESTART_COUNT=1)" in stderr
    assert f"port {port} on 127.0.0.1 is in use" in stderr
    # With --log_dir the ranks write to their files, not through ds-launch.
    assert "attempt" not in stdout
    for rank in (0, 1):
        log = (logs / f"rank_{rank}.log").read_text()
        assert log.index(f"rank {rank} attempt 0") < log.index("===== ds-launch: restart 1 =====")
        assert log.index("===== ds-launch: restart 1 =====") < log.index(f"rank {rank} attempt 1")


@pytest.mark.slow
def test_restarts_give_up_with_the_failed_code(tmp_path: Path) -> None:
    job = _job(tmp_path)
    done = _probes.ds_launch(
        "--nproc_per_node",
        "2",
        "--max_restarts",
        "1",
        "--log_dir",
        "logs",
        "restarting.py",
        "out",
        cwd=job,
        env=_probes.launcher_env(FAIL_UNTIL="99"),
    )
    assert done.returncode == 5
    assert done.stderr.count("rank 1 (local rank 1 on localhost) exited with code 5") == 2
    assert done.stderr.count("restarting the job") == 1
    # The report's tail comes from the log file of the failed attempt.
    assert done.stderr.rstrip().endswith("    rank 1 attempt 1")
    assert sorted(p.name for p in (job / "out").iterdir()) == [
        f"rank{r}.restart{a}.json" for r in (0, 1) for a in (0, 1)
    ]


@pytest.mark.slow
def test_a_busy_port_is_replaced_by_a_free_one(tmp_path: Path) -> None:
    (tmp_path / "out").mkdir()
    (tmp_path / "probe.py").write_text(_probes.PROBE)
    with _listening_socket() as busy:
        port = busy.getsockname()[1]
        done = _probes.ds_launch(
            "--nproc_per_node", "2", "--master_port", str(port), "probe.py", "out", cwd=tmp_path
        )
    assert done.returncode == 0, done.stderr
    chosen = {record["env"]["MASTER_PORT"] for record in _probes.records(tmp_path / "out")}
    assert len(chosen) == 1 and chosen != {str(port)}
    assert f"port {port} on 127.0.0.1 is in use, using free port {chosen.pop()}" in done.stderr
