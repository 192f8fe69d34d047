"""ds-launch names the stuck ranks from a hang report in the failed rank's output (no processes)."""

from __future__ import annotations

from deepshard.interface.watchdog import format_watchdog_line
from deepshard.launcher._watchdog_notice import watchdog_notice


def test_the_notice_names_the_ranks_of_the_last_report() -> None:
    older = format_watchdog_line(2, "waited 3.0 s in barrier #1", [0])
    newer = format_watchdog_line(2, "waited 3.0 s in all_reduce #9 (float32[4])", [1, 3])
    tail = [
        "Traceback (most recent call last):",
        f"[rank2]: deepshard.interface.errors.CommError: {older}",
        f"[rank2]: deepshard.interface.errors.CommError: {newer}",
        "[rank2]:   rank 1 behind: last here: all_reduce #8",
    ]
    assert watchdog_notice(tail) == (
        "ds-launch: the comms watchdog (DEEPSHARD_WATCHDOG_S) on rank 2 stopped the job: ranks "
        "1, 3 never arrived (rank 2 waited 3.0 s in all_reduce #9 (float32[4]))\n"
        "ds-launch: stuck ranks: 1, 3\n"
    )


def test_many_stuck_ranks_are_counted_and_other_failures_get_no_notice() -> None:
    line = format_watchdog_line(0, "waited 2.0 s in barrier #1", list(range(1, 21)))
    assert watchdog_notice([line]).endswith(
        "ds-launch: stuck ranks: 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16 and 4 more\n"
    )
    assert watchdog_notice(["Traceback (most recent call last):", "ValueError: boom"]) == ""
    assert watchdog_notice([]) == ""
