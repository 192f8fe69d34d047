"""A throwaway sshd on 127.0.0.1 for the ssh-backend tests, and the package installer they share.

Nothing here touches the machine's own ssh set-up: the host key, the client key, the
``authorized_keys`` file, the server and client configs and the logs all live in a temporary
directory, the server listens on a free port of 127.0.0.1 only, and `running_sshd` stops it
when the ``with`` block ends (also when the test inside failed). The only system-wide effects
are installing ``openssh-server`` when it is missing and creating sshd's privilege-separation
directory ``/run/sshd`` (sshd refuses to start without it).

This is a plain module imported by path from the test files (pytest runs with
``--import-mode=importlib``, so ``tests/`` is not on ``sys.path``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import os
import pwd
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import IO

SSHD = "/usr/sbin/sshd"
PACKAGES = {
    SSHD: "openssh-server",
    "/usr/bin/ssh": "openssh-client",
    "/usr/bin/ssh-keygen": "openssh-client",
}
APT_LOCK = Path("/tmp/deepshard-tests-apt.lock")
"""Serialises our installs (two test sessions at once); apt's own lock is waited on as well."""
APT_BUDGET_S = 240.0
"""Wall time an install may take, lock waits included; below pytest's 300 s test timeout."""


class Unavailable(Exception):
    """The machine cannot provide what a real multi-node test needs; the test is skipped."""


def free_ports(count: int) -> list[int]:
    """``count`` distinct TCP ports of 127.0.0.1 that were free a moment ago."""
    with contextlib.ExitStack() as stack:
        probes = [stack.enter_context(socket.socket()) for _ in range(count)]
        for probe in probes:  # all held open at once, so the kernel hands out distinct ports
            probe.bind(("127.0.0.1", 0))
        return [int(probe.getsockname()[1]) for probe in probes]


def require_root(what: str) -> None:
    """Raise `Unavailable` unless this process is root (installing and starting daemons)."""
    if os.geteuid() != 0:
        raise Unavailable(
            f"{what} needs root rights (to install Debian packages and start daemons); "
            "run the test suite as root, as .ci/run does in CI"
        )


def _apt(args: list[str], deadline: float) -> subprocess.CompletedProcess[str]:
    left = deadline - time.monotonic()
    if left <= 0:
        raise Unavailable(f"installing took more than {APT_BUDGET_S:.0f} s; giving up")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    command = ["apt-get", "-o", f"DPkg::Lock::Timeout={int(left)}", *args]
    try:
        return subprocess.run(
            command, env=env, capture_output=True, text=True, timeout=left, check=False
        )
    except subprocess.TimeoutExpired:
        raise Unavailable(f"{' '.join(command)} ran past {APT_BUDGET_S:.0f} s") from None


def _lock(handle: IO[str], deadline: float) -> None:
    """Take our install lock (another test session may be installing the same packages)."""
    while True:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() > deadline:
                raise Unavailable(f"{APT_LOCK} stayed locked for {APT_BUDGET_S:.0f} s") from None
            time.sleep(0.5)


def _missing(binaries: Mapping[str, str]) -> list[str]:
    return sorted({pkg for path, pkg in binaries.items() if not os.access(path, os.X_OK)})


def ensure_debian_packages(binaries: Mapping[str, str]) -> float:
    """Install the Debian packages whose programs are missing; return the seconds it took.

    Installs with ``apt-get install -y --no-install-recommends``, refreshing the package
    lists once if that fails; waits for apt's lock and for another test session's install.

    Args:
        binaries: Absolute program path -> the Debian package that provides it.

    Returns:
        Wall time spent installing (0.0 when everything was there).

    Raises:
        Unavailable: Not root, no apt-get, apt-get failed (no network, no such package; its
            last output is in the message) or it took longer than `APT_BUDGET_S`.
    """
    missing = _missing(binaries)
    if not missing:
        return 0.0
    require_root(f"installing {' '.join(missing)}")
    if shutil.which("apt-get") is None:
        raise Unavailable(f"{' '.join(missing)} missing and there is no apt-get to install them")
    start = time.monotonic()
    deadline = start + APT_BUDGET_S
    APT_LOCK.touch(exist_ok=True)
    with APT_LOCK.open() as lock:
        _lock(lock, deadline)
        still_missing = _missing(binaries)  # the other session may have installed them
        if still_missing:
            install = ["install", "-y", "--no-install-recommends", *still_missing]
            result = _apt(install, deadline)
            if result.returncode != 0:  # stale or absent package lists: refresh once, retry
                _apt(["update"], deadline)
                result = _apt(install, deadline)
            if result.returncode != 0:
                tail = (result.stdout + result.stderr).strip()[-1500:]
                raise Unavailable(f"apt-get {' '.join(install)} failed:\n{tail}")
    absent = [path for path in binaries if not os.access(path, os.X_OK)]
    if absent:
        raise Unavailable(f"installed {' '.join(missing)} but {' '.join(absent)} is still missing")
    return time.monotonic() - start


@dataclasses.dataclass(frozen=True)
class SshServer:
    """A running test sshd and what a client needs to log in to it.

    Attributes:
        port: The port it listens on (127.0.0.1 only).
        client_config: An ssh client config (``ssh -F``) with the client key, no host-key
            checking and no known-hosts file; it names no port, so the caller must pass one.
        log: The server's log file (sshd ``-E``).
        user: The user to log in as (the one running the tests).
        timings: Seconds spent installing (``install``) and starting until a first login
            succeeded (``start``).
    """

    port: int
    client_config: Path
    log: Path
    user: str
    timings: dict[str, float]

    def ssh_command(self, host: str = "127.0.0.1") -> list[str]:
        """The ``ssh`` argv prefix that logs in to this server on ``host``."""
        return ["ssh", "-F", str(self.client_config), "-p", str(self.port), f"{self.user}@{host}"]


def _keygen(path: Path) -> None:
    subprocess.run(
        ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "deepshard-test", "-f", str(path)],
        check=True,
        capture_output=True,
        timeout=60,
    )


def _write_configs(root: Path, port: int) -> tuple[Path, Path]:
    host_key, client_key = root / "host_ed25519", root / "client_ed25519"
    _keygen(host_key)
    _keygen(client_key)
    authorized = root / "authorized_keys"
    authorized.write_text(Path(f"{client_key}.pub").read_text())
    server_config = root / "sshd_config"
    server_config.write_text(
        "\n".join(
            [
                f"Port {port}",
                "ListenAddress 127.0.0.1",
                f"HostKey {host_key}",
                f"PidFile {root / 'sshd.pid'}",
                f"AuthorizedKeysFile {authorized}",
                "StrictModes no",
                "PermitRootLogin prohibit-password",
                "PubkeyAuthentication yes",
                "PasswordAuthentication no",
                "KbdInteractiveAuthentication no",
                "UsePAM no",
                "PrintMotd no",
                "LogLevel VERBOSE",
                "MaxStartups 50",
                "",
            ]
        )
    )
    client_config = root / "ssh_config"
    client_config.write_text(
        "\n".join(
            [
                "Host *",
                f"    IdentityFile {client_key}",
                "    IdentitiesOnly yes",
                "    StrictHostKeyChecking no",
                "    UserKnownHostsFile /dev/null",
                "    GlobalKnownHostsFile /dev/null",
                "    BatchMode yes",
                "    LogLevel ERROR",
                "    ConnectTimeout 20",
                "",
            ]
        )
    )
    return server_config, client_config


def _wait_until_serving(server: SshServer, process: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 30
    last = ""
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(
                f"sshd exited with {process.returncode}:\n{server.log.read_text(errors='replace')}"
            )
        probe = subprocess.run(
            [*server.ssh_command(), "true"], capture_output=True, text=True, timeout=30
        )
        if probe.returncode == 0:
            return
        last = probe.stderr
        time.sleep(0.2)
    raise RuntimeError(
        f"sshd on 127.0.0.1:{server.port} accepted no login within 30 s; ssh said: {last}\n"
        f"sshd log:\n{server.log.read_text(errors='replace')}"
    )


@contextlib.contextmanager
def running_sshd(root: Path) -> Iterator[SshServer]:
    """Start an sshd on a free port of 127.0.0.1 that accepts a fresh key; stop it on exit.

    Args:
        root: An empty private directory for keys, configs and the log.

    Yields:
        The running server; a login with ``server.ssh_command()`` has already succeeded.

    Raises:
        Unavailable: Not root, or ``openssh-server`` is missing and cannot be installed.
        RuntimeError: sshd did not start or refused the key (its log is in the message).
    """
    require_root("an sshd on 127.0.0.1")
    timings = {"install": ensure_debian_packages(PACKAGES)}
    clock = time.monotonic()
    Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # sshd's compiled-in privsep directory
    (port,) = free_ports(1)
    server_config, client_config = _write_configs(root, port)
    user = pwd.getpwuid(os.geteuid()).pw_name
    server = SshServer(port, client_config, root / "sshd.log", user, timings)
    process = subprocess.Popen(
        [SSHD, "-D", "-f", str(server_config), "-E", str(server.log)],
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        _wait_until_serving(server, process)
        timings["start"] = time.monotonic() - clock
        yield server
    finally:
        stop_process(process)


def stop_process(process: subprocess.Popen[bytes]) -> None:
    """Stop a daemon we started, and its process group (it was started in a new session)."""
    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, 15)
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, 9)
            process.wait(timeout=10)


def kill_processes_with(marker: str) -> list[int]:
    """SIGKILL every process (but this one) whose command line or environment holds ``marker``.

    Daemons hand work to processes outside their own session (sshd's per-login children,
    slurmstepd), so stopping the daemon does not stop a rank that hangs. ``marker`` must be
    unique to the test (a path inside its temporary directory), so that only processes the test
    started, directly or through a daemon, match.

    Returns:
        The pids that were killed.
    """
    needle = marker.encode()
    killed = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            text = (entry / "cmdline").read_bytes() + b"\0" + (entry / "environ").read_bytes()
        except OSError:  # gone meanwhile, or not ours to read
            continue
        if needle in text:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(int(entry.name), 9)
                killed.append(int(entry.name))
    return killed
