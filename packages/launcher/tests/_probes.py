"""Shared by the launcher's real-process tests: probe scripts and a ``ds-launch`` runner.

A plain module imported by path (pytest's importlib mode keeps ``tests/`` off ``sys.path``):
``_probes = import_beside(__file__, "_probes.py")`` (`deepshard.testing`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

DS_LAUNCH = [str(Path(sys.executable).parent / "ds-launch")]
"""How tests run the launcher: the installed console script."""

ENV_KEYS = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "LOCAL_SIZE",
    "CROSS_RANK",
    "CROSS_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "OMP_NUM_THREADS",
    "CUDA_VISIBLE_DEVICES",
    "DEEPSHARD_RESTART_COUNT",
    "DEEPSHARD_PROBE",
)

# Records what the rank saw in OUT/rank<RANK>.restart<N>.json, where OUT is the first argument.
PROBE = f"""\
import json, os, sys
from pathlib import Path

keys = {ENV_KEYS!r}
record = {{
    "env": {{k: os.environ.get(k) for k in keys}},
    "argv": sys.argv[1:],
    "cpus": sorted(os.sched_getaffinity(0)),
    "pid": os.getpid(),
    "cwd": os.getcwd(),
    "name": __name__,
}}
out = Path(sys.argv[1])
name = f"rank{{os.environ['RANK']}}.restart{{os.environ['DEEPSHARD_RESTART_COUNT']}}.json"
(out / name).write_text(json.dumps(record))
"""

# Rank 1 (or the rank named by FAIL_RANK) fails as told by FAIL_HOW (an exit code, or "kill")
# after every rank has started a grandchild and written both pids to OUT/pids<RANK>; the others
# sleep (ignoring SIGTERM when IGNORE_TERM is set).
FAILING = """\
import os, signal, subprocess, sys, time
from pathlib import Path

out = Path(sys.argv[1])
rank = int(os.environ["RANK"])
failing = rank == int(os.environ.get("FAIL_RANK", "1"))
if os.environ.get("IGNORE_TERM") and not failing:  # only SIGKILL can stop this one
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
(out / f"pids{rank}").write_text(f"{os.getpid()} {child.pid}")
print(f"rank {rank} ready", flush=True)
if failing:
    while len(list(out.glob("pids*"))) < int(os.environ["WORLD_SIZE"]):
        time.sleep(0.05)
    print("about to fail: the last words", flush=True)
    how = os.environ["FAIL_HOW"]
    if how == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    sys.exit(int(how))
time.sleep(120)
"""


def launcher_env(**extra: str) -> dict[str, str]:
    """The test's environment for ``ds-launch``: no launcher variables, one thread, CPU only."""
    drop = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "CUDA_VISIBLE")
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    env = {k: v for k, v in env.items() if not k.startswith(("SLURM_", "OMPI_", "DEEPSHARD_"))}
    env.update(OMP_NUM_THREADS="1", DEEPSHARD_NUM_ACCELERATORS="0")
    env.update(extra)
    return env


def ds_launch(
    *args: str,
    cwd: Path,
    env: dict[str, str] | None = None,
    timeout: float = 60,
) -> subprocess.CompletedProcess[str]:
    """Run ``ds-launch args...`` to completion, capturing its output."""
    return subprocess.run(
        [*DS_LAUNCH, *args],
        cwd=cwd,
        env=env if env is not None else launcher_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def records(out: Path, restart: int = 0) -> list[dict[str, Any]]:
    """The probe records of one attempt, by rank."""
    files = out.glob(f"rank*.restart{restart}.json")
    files = sorted(files, key=lambda path: int(path.name[4:].split(".")[0]))
    return [json.loads(path.read_text()) for path in files]


def process_running(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie (an exited orphan waiting to be reaped)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return False
    return stat[stat.rfind(b")") + 2 : stat.rfind(b")") + 3] not in (b"Z", b"X")


def wait_for_files(directory: Path, pattern: str, count: int, timeout: float = 30) -> list[Path]:
    """Wait until ``count`` files match ``pattern`` in ``directory``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = sorted(directory.glob(pattern))
        if len(found) >= count:
            return found
        time.sleep(0.05)
    raise AssertionError(f"{count} files {pattern} did not appear in {directory} in {timeout} s")


def recorded_pids(out: Path) -> list[int]:
    """Every rank and grandchild pid the FAILING script wrote."""
    return [int(pid) for path in out.glob("pids*") for pid in path.read_text().split()]
