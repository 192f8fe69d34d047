"""What the supervisor is given and what it returns: process specs, policy, outcome."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:  # _rank_errors imports this module
    from deepshard.launcher._rank_errors import RankError

__all__ = ["Outcome", "ProcessSpec", "SupervisionPolicy", "exit_code_of"]


@dataclasses.dataclass(frozen=True)
class ProcessSpec:
    """One child to start and supervise.

    Attributes:
        label: How messages name it, e.g. ``"rank 3 (local rank 1 on worker-0)"``.
        argv: The command.
        env: Its complete environment.
        cwd: Its working directory (``None``: the launcher's).
        prefix: Put before each output line when relaying (``b""``: relay unchanged).
        log_path: Send stdout and stderr to this file (appending) instead of relaying them.
        cpus: Logical CPUs to pin it to, or ``None``.
        stop_mode: ``"group"``: signal its process group; ``"stdin"``: write ``stop N`` to its
            stdin and close it (the ssh client of a node entry).
        shown_env: The variables the launcher set for it, for ``--dry_run``.
        signal_map: ``(received, sent)`` pairs: the signal to pass on instead of the one the
            launcher received (srun and pdsh answer a single SIGINT with a status report, so
            they get SIGTERM instead).
        reports_errors: It runs through `deepshard.launcher.script`: when its output is
            relayed, it is given a ``DEEPSHARD_ERROR_FILE`` for the DeepShard error it may stop
            with, and the report prints that error once for all ranks.
    """

    label: str
    argv: tuple[str, ...]
    env: Mapping[str, str]
    cwd: str | None = None
    prefix: bytes = b""
    log_path: str | None = None
    cpus: tuple[int, ...] | None = None
    stop_mode: Literal["group", "stdin"] = "group"
    shown_env: tuple[tuple[str, str], ...] = ()
    signal_map: tuple[tuple[int, int], ...] = ()
    reports_errors: bool = False


@dataclasses.dataclass(frozen=True)
class SupervisionPolicy:
    """How the group is watched and stopped.

    Attributes:
        grace_s: Seconds between asking a child to stop and killing it.
        poll_s: Seconds between exit checks (bounds how late a failure is noticed).
        tail_lines: Output lines kept per child for the failure report.
        stop_command: Given the signal number, a command to run once when the group is
            stopped (pdsh has no stdin to close, so its node entries are stopped this way).
    """

    grace_s: float = 3.0
    poll_s: float = 0.05
    tail_lines: int = 20
    stop_command: Callable[[int], Sequence[str]] | None = None


@dataclasses.dataclass(frozen=True)
class Outcome:
    """How the group ended.

    Attributes:
        exit_code: What the launcher should exit with.
        failed: The child that failed first, or ``None``.
        returncode: Its raw return code (negative for a signal), or ``None``.
        received_signal: The signal the launcher received, or ``None``.
        tail: The failed child's last output lines.
        errors: The DeepShard errors children reported (`ProcessSpec.reports_errors`), in
            start order.
    """

    exit_code: int
    failed: ProcessSpec | None = None
    returncode: int | None = None
    received_signal: int | None = None
    tail: tuple[str, ...] = ()
    errors: tuple[tuple[ProcessSpec, RankError], ...] = ()


def exit_code_of(returncode: int) -> int:
    """A shell's view of a return code: death by signal ``N`` is ``128 + N``."""
    return 128 - returncode if returncode < 0 else returncode
