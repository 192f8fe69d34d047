"""What ``ds-launch`` tells the user when a job ends badly."""

from __future__ import annotations

import signal

from deepshard.launcher._rank_errors import describe_rank_errors
from deepshard.launcher._specs import Outcome

__all__ = ["REPORT_MARK", "describe_outcome"]

REPORT_MARK = "ds-launch: "
"""Every line ``ds-launch`` prints itself starts with this."""


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def describe_outcome(outcome: Outcome, *, show_tail: bool = True) -> str:
    """The report for a job that did not succeed (``""`` for a clean exit).

    DeepShard errors the ranks reported come first, each once with the ranks that raised it;
    the failed child's output tail is left out when it reported one (its output was relayed
    already, and the error says what went wrong).

    Args:
        outcome: How the group ended.
        show_tail: Include the failed child's last output lines.

    Returns:
        Lines starting with ``ds-launch: ``, ending with a newline; ``""`` on success.
    """
    if outcome.received_signal is not None:
        return (
            f"{REPORT_MARK}received {_signal_name(outcome.received_signal)}; stopped every "
            f"process (exit code {outcome.exit_code})\n"
        )
    if outcome.failed is None or outcome.returncode is None:
        return ""
    code = outcome.returncode
    if code < 0:
        how = f"was killed by {_signal_name(-code)} (exit code {outcome.exit_code})"
    else:
        how = f"exited with code {code}"
    lines = describe_rank_errors(outcome.errors, REPORT_MARK)
    lines.append(f"{REPORT_MARK}{outcome.failed.label} {how}; the other processes were stopped")
    if show_tail and all(spec is not outcome.failed for spec, _ in outcome.errors):
        if outcome.tail:
            lines.append(f"{REPORT_MARK}last {len(outcome.tail)} lines of its output:")
            lines.extend(f"    {line}" for line in outcome.tail)
        else:
            lines.append(f"{REPORT_MARK}it printed nothing")
    return "\n".join(lines) + "\n"
