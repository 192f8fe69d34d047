"""Running a group of processes that live and die together.

One loop, in the launcher's main thread, without helper threads (``preexec_fn`` is only safe in
a single-threaded parent): it relays the children's pipes through a selector and polls their
exits every `SupervisionPolicy.poll_s`. The rules:

- The first child that exits non-zero, or dies by a signal, fails the group: every other child
  is asked to stop at once, and the group's exit code is that child's (a signal ``N`` reads as
  ``128 + N``, like a shell).
- ``SIGINT``, ``SIGTERM`` or ``SIGHUP`` to the launcher is passed on to every child; the exit
  code is ``128 + N``. A second signal skips the grace period.
- A child that has not exited ``grace_s`` after being asked is killed with ``SIGKILL``.
- At the end, in every case, what is left of each child's process group (processes the child
  started and abandoned) is terminated the same way, so nothing outlives the launcher.
- A relayed rank (`ProcessSpec.reports_errors`) gets a ``DEEPSHARD_ERROR_FILE`` in a temporary
  directory of this supervision; after a failure the errors found there go into the `Outcome`
  (see `deepshard.launcher._rank_errors`).

"Asking to stop" depends on the child: a rank (or srun/mpirun/pdsh client) gets the signal on its
process group; the ssh client of a remote node gets ``stop <signal>`` on its stdin and then EOF,
which the node entry on the other side turns into the same treatment of its own ranks.
"""

from __future__ import annotations

import contextlib
import os
import selectors
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from types import FrameType
from typing import BinaryIO

from deepshard.interface.errors import LaunchError
from deepshard.launcher._guard import GroupGuard
from deepshard.launcher._output import LineTail, StreamRelay, read_file_tail
from deepshard.launcher._process import child_setup, group_alive, signal_group
from deepshard.launcher._rank_errors import ERROR_FILE_ENV, RankError, read_error_file
from deepshard.launcher._specs import (
    Outcome,
    ProcessSpec,
    SupervisionPolicy,
    exit_code_of,
)

__all__ = ["supervise"]

_FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_READ_SIZE = 1 << 16


class _Signals:
    """Records SIGINT/SIGTERM/SIGHUP while installed (main thread only); restores on exit."""

    def __init__(self) -> None:
        self.received: list[int] = []
        self._previous: dict[int, object] = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.received.append(signum)

    def __enter__(self) -> _Signals:
        for signum in _FORWARDED:
            try:
                self._previous[signum] = signal.signal(signum, self._handle)
            except ValueError:  # not the main thread: the caller handles signals itself
                break
        return self

    def __exit__(self, *exc: object) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)  # type: ignore[arg-type]


class _ControlReader:
    """Reads ``stop N`` lines from a control stream; EOF counts as ``stop 15`` (SIGTERM).

    A node entry started over ssh watches its stdin this way: the launcher writes ``stop N``
    and closes it to stop the node, and if the launcher or its ssh client dies, the connection
    drops and the stdin reaches EOF.
    """

    def __init__(self, signals: _Signals) -> None:
        self._signals = signals
        self._pending = b""
        self._requested = False

    def feed(self, data: bytes) -> None:
        *lines, self._pending = (self._pending + data).split(b"\n")
        for line in lines:
            word, _, number = line.decode(errors="replace").strip().partition(" ")
            if word == "stop":
                self._requested = True
                self._signals.received.append(int(number) if number.isdigit() else 15)

    def close(self) -> None:
        if not self._requested:
            self._requested = True
            self._signals.received.append(int(signal.SIGTERM))


class _Child:
    """A started child: its process, pipes and remembered output."""

    def __init__(
        self,
        spec: ProcessSpec,
        process: subprocess.Popen[bytes],
        tail: LineTail,
        error_file: str | None,
    ) -> None:
        self.spec = spec
        self.process = process
        self.tail = tail
        self.error_file = error_file
        self.returncode: int | None = None

    def ask_to_stop(self, signum: int) -> None:
        signum = dict(self.spec.signal_map).get(signum, signum)
        if self.spec.stop_mode == "stdin" and self.process.stdin is not None:
            with contextlib.suppress(OSError):  # the client may be gone already
                if not self.process.stdin.closed:
                    self.process.stdin.write(f"stop {signum}\n".encode())
                    self.process.stdin.close()
        else:
            signal_group(self.process.pid, signum)

    def reported_error(self) -> RankError | None:
        return None if self.error_file is None else read_error_file(self.error_file)

    def output_tail(self, limit: int) -> tuple[str, ...]:
        if self.spec.log_path is not None:
            return tuple(read_file_tail(self.spec.log_path, limit))
        return tuple(self.tail.lines())


def _start(
    spec: ProcessSpec,
    policy: SupervisionPolicy,
    selector: selectors.BaseSelector,
    out: BinaryIO,
    err: BinaryIO,
    error_file: str,
) -> _Child:
    env = dict(spec.env)
    # A rank writing to its own log keeps its error message there (the report shows its tail).
    reports = spec.reports_errors and spec.log_path is None
    if reports:
        env[ERROR_FILE_ENV] = error_file
    log = open(spec.log_path, "ab") if spec.log_path is not None else None  # noqa: SIM115
    try:
        process = subprocess.Popen(
            list(spec.argv),
            env=env,
            cwd=spec.cwd,
            stdin=subprocess.PIPE if spec.stop_mode == "stdin" else subprocess.DEVNULL,
            stdout=log if log is not None else subprocess.PIPE,
            stderr=log if log is not None else subprocess.PIPE,
            start_new_session=True,
            preexec_fn=child_setup(spec.cpus),
        )
    except OSError as error:
        raise LaunchError(f"could not start {spec.label} ({spec.argv[0]}): {error}") from error
    finally:
        if log is not None:
            log.close()
    tail = LineTail(policy.tail_lines)
    for stream, pipe, destination in ((1, process.stdout, out), (2, process.stderr, err)):
        if pipe is not None:
            os.set_blocking(pipe.fileno(), False)
            relay = StreamRelay(destination, spec.prefix, stream, tail)
            selector.register(pipe, selectors.EVENT_READ, relay)
    return _Child(spec, process, tail, error_file if reports else None)


class _Supervision:
    """The loop's state: children, the first failure, and the stop in progress."""

    def __init__(
        self,
        children: list[_Child],
        selector: selectors.BaseSelector,
        signals: _Signals,
        policy: SupervisionPolicy,
    ) -> None:
        self.children = children
        self.selector = selector
        self.signals = signals
        self.policy = policy
        self.failed: _Child | None = None
        self.stop_deadline: float | None = None
        self.killed = False
        self.helpers: list[subprocess.Popen[bytes]] = []

    def run(self) -> Outcome:
        handled_signals = 0
        while any(child.returncode is None for child in self.children):
            self._relay(self.policy.poll_s)
            self._reap()
            if len(self.signals.received) > handled_signals:
                handled_signals = len(self.signals.received)
                if self.stop_deadline is None:
                    self._begin_stop(self.signals.received[0])
                else:
                    self._kill_all()  # a second signal: no more grace
            if self.stop_deadline is not None and time.monotonic() >= self.stop_deadline:
                self._kill_all()
        self._drain()
        self._sweep_groups()
        return self._outcome()

    def _relay(self, timeout: float) -> bool:
        got_data = False
        for key, _ in self.selector.select(timeout):
            relay: StreamRelay | _ControlReader = key.data
            try:
                data = os.read(key.fd, _READ_SIZE)
            except BlockingIOError:
                continue
            if data:
                relay.feed(data)
                got_data = True
            else:
                relay.close()
                self.selector.unregister(key.fileobj)
                key.fileobj.close()  # type: ignore[union-attr]
        return got_data

    def _reap(self) -> None:
        for child in self.children:
            if child.returncode is not None:
                continue
            returncode = child.process.poll()
            if returncode is None:
                continue
            child.returncode = returncode
            if returncode != 0 and self.failed is None and self.stop_deadline is None:
                self.failed = child
                self._begin_stop(signal.SIGTERM)

    def _begin_stop(self, signum: int) -> None:
        self.stop_deadline = time.monotonic() + self.policy.grace_s
        for child in self.children:
            if child.returncode is None:
                child.ask_to_stop(signum)
        if self.policy.stop_command is not None:
            self.helpers.append(
                subprocess.Popen(
                    list(self.policy.stop_command(signum)),
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                    start_new_session=True,
                    preexec_fn=child_setup(),
                )
            )

    def _kill_all(self) -> None:
        if self.killed:
            return
        self.killed = True
        for child in self.children:
            if child.returncode is None:
                signal_group(child.process.pid, signal.SIGKILL)

    def _drain(self) -> None:
        # Children that exited may have left a grandchild holding the pipe open: read what is
        # buffered, but do not wait for an EOF that may never come.
        # The control stream no longer matters: everything has exited.
        for key in list(self.selector.get_map().values()):
            if isinstance(key.data, _ControlReader):
                self.selector.unregister(key.fileobj)
        deadline = time.monotonic() + 0.5
        while self.selector.get_map() and time.monotonic() < deadline and self._relay(0.05):
            pass
        for key in list(self.selector.get_map().values()):
            key.data.close()
            self.selector.unregister(key.fileobj)
            key.fileobj.close()  # type: ignore[union-attr]
        for child in self.children:
            if child.process.stdin is not None and not child.process.stdin.closed:
                with contextlib.suppress(OSError):
                    child.process.stdin.close()

    def _sweep_groups(self) -> None:
        alive = [child for child in self.children if group_alive(child.process.pid)]
        for child in alive:
            signal_group(child.process.pid, signal.SIGTERM)
        deadline = time.monotonic() + self.policy.grace_s
        while alive and time.monotonic() < deadline:
            time.sleep(self.policy.poll_s)
            alive = [child for child in alive if group_alive(child.process.pid)]
        for child in alive:
            signal_group(child.process.pid, signal.SIGKILL)
        for helper in self.helpers:
            try:
                helper.wait(timeout=self.policy.grace_s)
            except subprocess.TimeoutExpired:
                signal_group(helper.pid, signal.SIGKILL)
                helper.wait()

    def _outcome(self) -> Outcome:
        if self.failed is not None and self.failed.returncode is not None:
            reported = [(child.spec, child.reported_error()) for child in self.children]
            return Outcome(
                exit_code_of(self.failed.returncode),
                self.failed.spec,
                self.failed.returncode,
                None,
                self.failed.output_tail(self.policy.tail_lines),
                tuple((spec, error) for spec, error in reported if error is not None),
            )
        if self.signals.received:
            signum = self.signals.received[0]
            return Outcome(128 + signum, received_signal=signum)
        return Outcome(0)


def supervise(
    specs: Sequence[ProcessSpec],
    policy: SupervisionPolicy | None = None,
    *,
    stdout: BinaryIO | None = None,
    stderr: BinaryIO | None = None,
    control: BinaryIO | None = None,
) -> Outcome:
    """Start ``specs`` together and supervise them until all have exited (see module docstring).

    Args:
        specs: The children, started in order.
        policy: Grace period, polling interval, tail length, stop command.
        stdout: Where relayed stdout goes (default: the launcher's stdout).
        stderr: Where relayed stderr goes (default: the launcher's stderr).
        control: A stream to watch for ``stop N`` lines and EOF, each handled like signal
            ``N`` (EOF: ``SIGTERM``) to the launcher; ``None`` to watch nothing.

    Returns:
        How the group ended.

    Raises:
        LaunchError: A child could not be started (those already started are stopped first).
    """
    policy = policy or SupervisionPolicy()
    out = stdout if stdout is not None else sys.stdout.buffer
    err = stderr if stderr is not None else sys.stderr.buffer
    # The guard is forked first, before any child or pipe exists (see deepshard.launcher._guard).
    with (
        GroupGuard(policy.grace_s) as guard,
        _Signals() as signals,
        selectors.DefaultSelector() as selector,
        tempfile.TemporaryDirectory(prefix="deepshard-errors-") as error_dir,
    ):
        if control is not None:
            os.set_blocking(control.fileno(), False)
            selector.register(control, selectors.EVENT_READ, _ControlReader(signals))
        children: list[_Child] = []
        supervision = _Supervision(children, selector, signals, policy)
        try:
            for index, spec in enumerate(specs):
                error_file = os.path.join(error_dir, f"{index}.json")
                children.append(_start(spec, policy, selector, out, err, error_file))
                guard.watch(children[-1].process.pid)
        except LaunchError:
            supervision._begin_stop(signal.SIGTERM)
            supervision.run()
            raise
        return supervision.run()
