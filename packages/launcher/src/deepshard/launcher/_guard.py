"""A watchdog that cleans up the children's process groups if the launcher is killed outright.

``PR_SET_PDEATHSIG`` takes a rank down with a ``kill -9``-ed launcher, but not what the rank
started (the setting is not inherited across ``fork``). So before starting anything, the
launcher forks a small watchdog into a session of its own, connected by a pipe. The launcher
writes each child's process-group id into the pipe as it starts the child, and ``done`` when it
has cleaned up itself. If the pipe reaches EOF without ``done`` (the launcher died, whatever
the signal), the watchdog sends ``SIGTERM`` to every group it was told about, then ``SIGKILL``
after the grace period, and exits.

The watchdog is a plain ``fork`` of the single-threaded launcher, before any child exists: it
closes every inherited descriptor but its pipe (so it never holds a caller's output pipe open),
and leaves with ``os._exit`` (no Python clean-up of the launcher's state runs twice).
"""

from __future__ import annotations

import contextlib
import os
import signal
import time

from deepshard.launcher._process import group_alive, signal_group

__all__ = ["GroupGuard"]


def _watch(read_fd: int, grace_s: float) -> None:
    """The watchdog's life: collect group ids until EOF; kill them unless told ``done``."""
    groups: list[int] = []
    pending = b""
    while True:
        try:
            data = os.read(read_fd, 4096)
        except InterruptedError:
            continue
        if not data:
            break
        pending += data
        *lines, pending = pending.split(b"\n")
        for line in lines:
            if line == b"done":
                return
            groups.append(int(line))
    for pgid in groups:
        signal_group(pgid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while any(group_alive(pgid) for pgid in groups) and time.monotonic() < deadline:
        time.sleep(0.05)
    for pgid in groups:
        signal_group(pgid, signal.SIGKILL)


class GroupGuard:
    """The launcher's end of the watchdog (see the module docstring).

    Use as a context manager around the whole supervision; on POSIX systems without ``fork``
    it does nothing.
    """

    def __init__(self, grace_s: float) -> None:
        self._grace_s = grace_s
        self._write_fd: int | None = None
        self._pid: int | None = None

    def __enter__(self) -> GroupGuard:
        if not hasattr(os, "fork"):
            return self
        read_fd, write_fd = os.pipe()
        pid = os.fork()
        if pid == 0:  # the watchdog
            code = 0
            try:
                os.setsid()
                for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
                    signal.signal(signum, signal.SIG_IGN)
                null = os.open(os.devnull, os.O_RDWR)
                for fd in (0, 1, 2):
                    os.dup2(null, fd)
                os.closerange(3, read_fd)
                os.closerange(read_fd + 1, os.sysconf("SC_OPEN_MAX"))
                _watch(read_fd, self._grace_s)
            except BaseException:
                code = 1
            finally:
                os._exit(code)
        os.close(read_fd)
        self._write_fd, self._pid = write_fd, pid
        return self

    def watch(self, pgid: int) -> None:
        """Tell the watchdog about a new child's process group."""
        self._send(f"{pgid}\n".encode())

    def _send(self, data: bytes) -> None:
        if self._write_fd is not None:
            with contextlib.suppress(OSError):
                os.write(self._write_fd, data)

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        """Release the watchdog (the launcher cleaned up itself) and reap it.

        If the block ends with an exception, the launcher may not have cleaned up: the pipe is
        closed without ``done`` and the watchdog cleans up instead.
        """
        if self._write_fd is None or self._pid is None:
            return
        if exc_type is None:
            self._send(b"done\n")
        os.close(self._write_fd)
        self._write_fd = None
        with contextlib.suppress(ChildProcessError):
            os.waitpid(self._pid, 0)
