"""Naming the stuck ranks when a rank's comms watchdog ended the job.

A rank that waited too long in a collective fails with a report whose summary line
(`deepshard.interface.watchdog`) names the ranks that had not arrived. The rank that fails first
is a *waiting* one, so the plain failure report would blame it; this notice, printed after it,
says which ranks the job was actually waiting for.
"""

from __future__ import annotations

from collections.abc import Sequence

from deepshard.interface.watchdog import WATCHDOG_ENV, parse_watchdog_line
from deepshard.launcher._report import REPORT_MARK

__all__ = ["watchdog_notice"]


def watchdog_notice(lines: Sequence[str]) -> str:
    """The ``ds-launch:`` lines for the last hang report among ``lines`` (``""`` if none).

    Args:
        lines: The failed rank's last output lines.
    """
    found = None
    for line in lines:
        found = parse_watchdog_line(line) or found
    if found is None:
        return ""
    stuck = ", ".join(str(rank) for rank in found.stuck)
    if found.more:
        stuck += f" and {found.more} more"
    plural = "s" if len(found.stuck) + found.more > 1 else ""
    return (
        f"{REPORT_MARK}the comms watchdog ({WATCHDOG_ENV}) on rank {found.rank} stopped the "
        f"job: rank{plural} {stuck} never arrived (rank {found.rank} {found.what})\n"
        f"{REPORT_MARK}stuck rank{plural}: {stuck}\n"
    )
