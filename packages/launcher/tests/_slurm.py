"""A one-node SLURM cluster on loopback (munged + slurmctld + slurmd) for the slurm-backend tests.

Everything lives in a temporary directory: a fresh MUNGE key and socket, ``slurm.conf`` (found
by every client through ``SLURM_CONF``), the controller's state, slurmd's spool, pid and log
files. The daemons listen on free ports, the node is called ``localhost`` at 127.0.0.1, no
accounting, no cgroups (``proctrack/linuxproc``, ``task/none``), so nothing of the machine's own
SLURM or MUNGE set-up is read or changed. `running_slurm` stops the daemons, and any process
started under this cluster, when the ``with`` block ends, also after a failed test.

This is a plain module imported by path from the test files (pytest runs with
``--import-mode=importlib``, so ``tests/`` is not on ``sys.path``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import pwd
import secrets
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

from deepshard.testing import import_beside

PACKAGES = {
    "/usr/sbin/munged": "munge",
    "/usr/bin/munge": "munge",
    "/usr/sbin/slurmctld": "slurmctld",
    "/usr/sbin/slurmd": "slurmd",
    "/usr/bin/srun": "slurm-client",
    "/usr/bin/sinfo": "slurm-client",
}
NODE = "localhost"
READY_TIMEOUT_S = 60.0


_sshd = import_beside(__file__, "_sshd.py")
Unavailable = _sshd.Unavailable


@dataclasses.dataclass(frozen=True)
class SlurmCluster:
    """A running one-node cluster.

    Attributes:
        conf: Its ``slurm.conf``.
        env: ``os.environ`` plus ``SLURM_CONF``: the environment for ``srun``, ``sinfo``, ...
        logs: Daemon name -> its log file.
        timings: Seconds spent per phase (``install``, ``munged``, ``daemons``, ``node_idle``).
    """

    conf: Path
    env: dict[str, str]
    logs: dict[str, Path]
    timings: dict[str, float]

    def diagnostics(self) -> str:
        """``sinfo``/``squeue`` output and the tail of every daemon log, for failure messages."""
        parts = [_client(self, ["sinfo", "-N", "-l"]), _client(self, ["squeue", "-a"])]
        for name, log in self.logs.items():
            text = log.read_text(errors="replace") if log.exists() else "(no log)"
            parts.append(f"--- {name} log ({log}) ---\n{text[-3000:]}")
        return "\n".join(parts)


def _client(cluster: SlurmCluster, argv: list[str]) -> str:
    try:
        done = subprocess.run(argv, env=cluster.env, capture_output=True, text=True, timeout=20)
    except subprocess.TimeoutExpired:
        return f"$ {' '.join(argv)}\n(timed out)"
    return f"$ {' '.join(argv)}\n{done.stdout}{done.stderr}"


def _start(argv: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    with log.open("ab") as out:
        return subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )


def _start_munged(root: Path, env: dict[str, str]) -> tuple[subprocess.Popen[bytes], Path]:
    """munged with its own key, socket, pid, seed and log files; returns it and its socket."""
    munge_dir = root / "munge"
    munge_dir.mkdir(mode=0o700)
    key = munge_dir / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    sock = munge_dir / "munge.socket"
    argv = [
        "/usr/sbin/munged",
        "--foreground",
        "--force",
        f"--key-file={key}",
        f"--socket={sock}",
        f"--pid-file={munge_dir / 'munged.pid'}",
        f"--seed-file={munge_dir / 'munged.seed'}",
        f"--log-file={munge_dir / 'munged.log'}",
    ]
    process = _start(argv, root / "munged.out", env)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if process.poll() is not None:
            break
        if sock.exists():
            cred = subprocess.run(
                ["/usr/bin/munge", "-n", "-S", str(sock)], capture_output=True, timeout=10
            )
            if cred.returncode == 0:
                return process, sock
        time.sleep(0.1)
    _sshd.stop_process(process)
    logs = [(root / "munged.out"), munge_dir / "munged.log"]
    text = "\n".join(p.read_text(errors="replace") for p in logs if p.exists())
    raise RuntimeError(f"munged did not come up within 20 s (exit {process.returncode}):\n{text}")


def _first_job_id() -> int:
    """A first job id whose rendezvous port is free now.

    Without ``MASTER_PORT``, ``deepshard.comm`` gives a SLURM job the port
    ``10000 + SLURM_JOB_ID % 20000``; a fresh cluster would start at job 1, port 10001, every
    time. Starting the ids where that port is free keeps the default path under test without
    colliding with whatever else listens on this machine.
    """
    for _ in range(100):
        job_id = secrets.randbelow(19_000) + 1  # leave room for the ids of the jobs that follow
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", 10_000 + job_id))
            except OSError:
                continue
            return job_id
    raise RuntimeError("no free port in 10001-29000 for a SLURM job's rendezvous")


def _slurm_conf(root: Path, munge_socket: Path, cpus: int) -> str:
    ctld_port, slurmd_port = _sshd.free_ports(2)
    lines = {
        "ClusterName": "deepshardtest",
        # The controller must be this host by name; its address is given, so no DNS is needed.
        "SlurmctldHost": f"{socket.gethostname().split('.')[0]}(127.0.0.1)",
        "SlurmctldPort": str(ctld_port),
        "SlurmdPort": str(slurmd_port),
        "SlurmUser": "root",
        "SlurmdUser": "root",
        "AuthType": "auth/munge",
        "CredType": "cred/munge",
        "AuthInfo": f"socket={munge_socket}",
        "StateSaveLocation": str(root / "state"),
        "SlurmdSpoolDir": str(root / "spool"),
        "SlurmctldPidFile": str(root / "slurmctld.pid"),
        "SlurmdPidFile": str(root / "slurmd.pid"),
        "SlurmctldLogFile": str(root / "slurmctld.log"),
        "SlurmdLogFile": str(root / "slurmd.log"),
        "SlurmctldDebug": "info",
        "SlurmdDebug": "info",
        "ProctrackType": "proctrack/linuxproc",
        "TaskPlugin": "task/none",
        "SelectType": "select/cons_tres",
        "SelectTypeParameters": "CR_CPU",
        "SchedulerType": "sched/builtin",
        "MpiDefault": "none",
        "SwitchType": "switch/none",
        "JobAcctGatherType": "jobacct_gather/none",
        "AccountingStorageType": "accounting_storage/none",
        "JobCompType": "jobcomp/none",
        "ReturnToService": "2",
        # The node's CPUs are what this file says even on a smaller machine (CI runners).
        "SlurmdParameters": "config_overrides",
        "SlurmctldTimeout": "30",
        "SlurmdTimeout": "30",
        "InactiveLimit": "0",
        "KillWait": "5",
        "MinJobAge": "60",
        "FirstJobId": str(_first_job_id()),
    }
    body = "".join(f"{key}={value}\n" for key, value in lines.items())
    body += f"NodeName={NODE} NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN\n"
    body += f"PartitionName=debug Nodes={NODE} Default=YES MaxTime=INFINITE State=UP\n"
    return body


def _node_state(env: dict[str, str]) -> str:
    done = subprocess.run(
        ["sinfo", "-h", "-N", "-n", NODE, "-o", "%T"],
        env=env,
        capture_output=True,
        text=True,
        timeout=20,
    )
    return done.stdout.strip() if done.returncode == 0 else f"sinfo failed: {done.stderr.strip()}"


def _wait_idle(cluster: SlurmCluster, daemons: list[subprocess.Popen[bytes]]) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    state = ""
    while time.monotonic() < deadline:
        dead = [p.args for p in daemons if p.poll() is not None]
        if dead:
            raise RuntimeError(f"SLURM daemon exited early: {dead}\n{cluster.diagnostics()}")
        state = _node_state(cluster.env)
        if state.rstrip("*") in {"idle", "mixed", "allocated"}:
            return
        time.sleep(0.5)
    raise RuntimeError(
        f"node {NODE} not idle within {READY_TIMEOUT_S:.0f} s (last state: {state!r})\n"
        f"{cluster.diagnostics()}"
    )


@contextlib.contextmanager
def running_slurm(root: Path, *, cpus: int = 2) -> Iterator[SlurmCluster]:
    """Install (if missing) and start munged, slurmctld and slurmd; stop them all on exit.

    Args:
        root: An empty private directory for keys, config, state and logs.
        cpus: CPUs the node advertises (``config_overrides`` makes SLURM believe it).

    Yields:
        The cluster, its node already idle.

    Raises:
        Unavailable: Not root, or the packages are missing and cannot be installed.
        RuntimeError: A daemon did not start or the node never became idle (logs attached).
    """
    _sshd.require_root("a SLURM cluster on loopback")
    timings = {"install": _sshd.ensure_debian_packages(PACKAGES)}
    root.chmod(0o700)
    (root / "state").mkdir()
    (root / "spool").mkdir()
    conf = root / "slurm.conf"
    env = {**os.environ, "SLURM_CONF": str(conf)}
    for name in [n for n in env if n.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_"))]:
        if name != "SLURM_CONF":  # a test run inside a real SLURM job must not leak into ours
            del env[name]
    started: list[subprocess.Popen[bytes]] = []
    logs = {
        "slurmctld": root / "slurmctld.log",
        "slurmd": root / "slurmd.log",
        "munged": root / "munge" / "munged.log",
    }
    try:
        clock = time.monotonic()
        munged, munge_socket = _start_munged(root, env)
        started.append(munged)
        timings["munged"] = time.monotonic() - clock
        conf.write_text(_slurm_conf(root, munge_socket, cpus))
        clock = time.monotonic()
        ctld = ["/usr/sbin/slurmctld", "-D", "-c", "-f", str(conf)]
        started.append(_start(ctld, root / "slurmctld.out", env))
        slurmd = ["/usr/sbin/slurmd", "-D", "-N", NODE, "-f", str(conf)]
        started.append(_start(slurmd, root / "slurmd.out", env))
        cluster = SlurmCluster(conf, env, logs, timings)
        timings["daemons"] = time.monotonic() - clock
        clock = time.monotonic()
        _wait_idle(cluster, started[1:])
        timings["node_idle"] = time.monotonic() - clock
        yield cluster
    finally:
        _teardown(conf, env, started)


def _teardown(conf: Path, env: dict[str, str], started: list[subprocess.Popen[bytes]]) -> None:
    if conf.exists():
        with contextlib.suppress(subprocess.SubprocessError, OSError):
            user = pwd.getpwuid(os.geteuid()).pw_name
            subprocess.run(["scancel", "--full", "--user", user], env=env, timeout=10)
    for process in reversed(started):  # slurmd, slurmctld, then munged
        _sshd.stop_process(process)
    # slurmstepd and the ranks leave slurmd's session; they carry our SLURM_CONF.
    _sshd.kill_processes_with(f"SLURM_CONF={conf}")
