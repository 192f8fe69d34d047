"""A rank's DeepShard error, reported once instead of as a traceback per rank.

Ranks run their script through `deepshard.launcher.script`. When the script stops with a
`deepshard.interface.errors.DeepShardError` (a config, topology or launch error: its message
already names the key and the fix, so a traceback adds nothing), the rank writes the error's
type and message as JSON to the file named by ``DEEPSHARD_ERROR_FILE`` and exits with code 1
without printing it. The supervisor gives every rank whose output it relays its own such file,
reads the files after the ranks have exited, and the failure report prints each distinct error
once with the ranks that raised it (`describe_rank_errors`): eight ranks failing on the same
config key print one message, not eight tracebacks.

``DEEPSHARD_TRACEBACK=1`` (or ``ds-launch --traceback``) turns this off: the error is raised as
usual and each rank prints its traceback. Without an error file (a rank writing to its own
``--log_dir`` file, or started by srun/mpirun) the rank prints the message to its stderr.

Standard library only: the script runner imports this before the user's script, in every rank.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence

from deepshard.launcher._specs import ProcessSpec

__all__ = [
    "ERROR_FILE_ENV",
    "TRACEBACK_ENV",
    "TRACEBACK_HINT",
    "RankError",
    "describe_rank_errors",
    "read_error_file",
    "traceback_requested",
    "write_error_file",
]

ERROR_FILE_ENV = "DEEPSHARD_ERROR_FILE"
"""Where a rank writes the DeepShard error that stopped it (set by the supervisor)."""

TRACEBACK_ENV = "DEEPSHARD_TRACEBACK"
"""``1`` (or ``true``/``yes``/``on``): ranks print the traceback of a DeepShard error."""

TRACEBACK_HINT = f"{TRACEBACK_ENV}=1 (or ds-launch --traceback) shows the traceback"
"""How the user asks for the traceback, printed under a reported error."""


@dataclasses.dataclass(frozen=True)
class RankError:
    """The DeepShard error a rank stopped with.

    Attributes:
        kind: The exception's class name, e.g. ``"ConfigError"``.
        message: ``str(error)``: what is wrong and how to fix it (may span several lines).
    """

    kind: str
    message: str


def traceback_requested(environ: Mapping[str, str]) -> bool:
    """Whether ``DEEPSHARD_TRACEBACK`` asks for tracebacks of DeepShard errors."""
    return environ.get(TRACEBACK_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def write_error_file(path: str, error: BaseException) -> None:
    """Record ``error`` at ``path`` for the supervisor.

    Raises:
        OSError: The file cannot be written (the caller then prints the error instead).
    """
    record = {"kind": type(error).__name__, "message": str(error)}
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(record, handle)


def read_error_file(path: str) -> RankError | None:
    """The error recorded at ``path``; ``None`` if the rank wrote none (or a torn file)."""
    try:
        with open(path, encoding="utf-8") as handle:
            record = json.load(handle)
        return RankError(str(record["kind"]), str(record["message"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _who(specs: Sequence[ProcessSpec]) -> str:
    ranks = [spec.env.get("RANK") for spec in specs]
    if all(rank is not None and rank.isdigit() for rank in ranks):
        numbers = sorted(int(rank) for rank in ranks if rank is not None)
        word = "rank" if len(numbers) == 1 else "ranks"
        return f"{word} {', '.join(map(str, numbers))}"
    return ", ".join(spec.label for spec in specs)


def describe_rank_errors(errors: Sequence[tuple[ProcessSpec, RankError]], mark: str) -> list[str]:
    """Report lines: each distinct error once, with the ranks that raised it.

    Two ranks' errors are the same when their type and message are; distinct errors are
    listed in the order their first rank appears in ``errors``.

    Args:
        errors: ``(rank, its error)`` pairs.
        mark: What the launcher's own lines start with (``"ds-launch: "``).

    Returns:
        Lines without newlines (``[]`` for no errors): per error a ``mark`` line naming the
        ranks and the message indented under it, then how to ask for the traceback.
    """
    groups: dict[RankError, list[ProcessSpec]] = {}
    for spec, error in errors:
        groups.setdefault(error, []).append(spec)
    lines = []
    for error, specs in groups.items():
        lines.append(f"{mark}{_who(specs)} stopped with {error.kind}:")
        lines.extend(f"    {line}" for line in error.message.splitlines() or [""])
    if lines:
        lines.append(f"{mark}{TRACEBACK_HINT}")
    return lines
