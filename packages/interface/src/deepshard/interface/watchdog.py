"""The line a rank's comms watchdog prints about a hang, and how the launcher reads it back.

A rank whose collective waits longer than the watchdog time (`deepshard.comm.CommWatchdog`)
fails with a report whose first line starts with `WATCHDOG_MARK` and names the ranks that had
not arrived. `ds-launch` recognizes that line in the failed rank's output and names the stuck
ranks itself. Both sides use this module (the launcher never imports torch), so the format is
defined once.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping, Sequence

from deepshard.interface.errors import ConfigError

__all__ = [
    "DEFAULT_WATCHDOG_S",
    "WATCHDOG_ENV",
    "WATCHDOG_MARK",
    "WatchdogLine",
    "format_watchdog_line",
    "parse_watchdog_line",
    "resolve_watchdog_s",
]

WATCHDOG_ENV = "DEEPSHARD_WATCHDOG_S"
"""Seconds a rank may wait in one collective before it reports the hang and fails (0: off)."""

DEFAULT_WATCHDOG_S = 120.0
"""The watchdog time without `comms_watchdog_s` or `DEEPSHARD_WATCHDOG_S`: 2 minutes, well
under the 10-minute process-group timeout, so a hang is reported before gloo/NCCL give up."""

WATCHDOG_MARK = "[deepshard watchdog]"
"""The first words of the summary line of every hang report."""

_LINE = re.compile(
    re.escape(WATCHDOG_MARK) + r" rank (?P<rank>\d+): (?P<what>.*?); "
    r"not arrived: ranks? (?P<stuck>\d+(?:, \d+)*)(?: \(\+(?P<more>\d+) more\))?$"
)
_MAX_NAMED = 16


@dataclasses.dataclass(frozen=True)
class WatchdogLine:
    """What a hang report's summary line says."""

    rank: int
    """The waiting rank that reported."""
    what: str
    """The collective it waited in: op, sequence number, shape, group, time, call site."""
    stuck: tuple[int, ...]
    """The ranks that had not arrived (the first 16 when there are more)."""
    more: int = 0
    """How many further ranks had not arrived beyond those in `stuck`."""


def format_watchdog_line(rank: int, what: str, stuck: Sequence[int]) -> str:
    """The summary line of a hang report (at most 16 ranks named, then a count).

    Args:
        rank: The reporting (waiting) rank.
        what: The collective it waited in; must not contain a newline.
        stuck: The ranks that had not arrived; at least one.
    """
    named = ", ".join(str(r) for r in stuck[:_MAX_NAMED])
    more = f" (+{len(stuck) - _MAX_NAMED} more)" if len(stuck) > _MAX_NAMED else ""
    plural = "s" if len(stuck) > 1 else ""
    return f"{WATCHDOG_MARK} rank {rank}: {what}; not arrived: rank{plural} {named}{more}"


def parse_watchdog_line(line: str) -> WatchdogLine | None:
    """Read a summary line back, wherever it sits in `line` (after a ``[rank N]`` prefix or
    an exception's class name); `None` for any other line."""
    start = line.find(WATCHDOG_MARK)
    if start < 0:
        return None
    match = _LINE.match(line[start:].rstrip())
    if match is None:
        return None
    stuck = tuple(int(r) for r in match["stuck"].split(", "))
    return WatchdogLine(int(match["rank"]), match["what"], stuck, int(match["more"] or 0))


def resolve_watchdog_s(configured: float | None, env: Mapping[str, str]) -> float | None:
    """The watchdog time in seconds, or `None` when the watchdog is off.

    The config value wins, then `DEEPSHARD_WATCHDOG_S`, then `DEFAULT_WATCHDOG_S`; 0 turns
    the watchdog off.

    Raises:
        ConfigError: The variable is not a number of seconds >= 0.
    """
    if configured is None:
        raw = env.get(WATCHDOG_ENV, "").strip()
        if not raw:
            return DEFAULT_WATCHDOG_S
        try:
            configured = float(raw)
        except ValueError:
            configured = math.nan
        if not (configured >= 0 and math.isfinite(configured)):
            raise ConfigError(
                f"environment variable {WATCHDOG_ENV}={raw!r} must be a number of seconds >= 0 "
                "(0 turns the comms watchdog off)"
            )
    return None if configured == 0 else float(configured)
