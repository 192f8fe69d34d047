"""Running a launch: dry run, supervision, failure report and ``--max_restarts``.

A restart re-plans the whole job (so the rendezvous port is checked again and replaced if a
stuck process still holds it) and starts every process afresh with ``DEEPSHARD_RESTART_COUNT``
one higher; the script is expected to resume from its last checkpoint. Only a failure is
restarted: a signal to ``ds-launch`` ends the job.
"""

from __future__ import annotations

import os
import shlex
from typing import TextIO

from deepshard.interface.errors import LaunchError
from deepshard.launcher._plan import LaunchOptions, LaunchPlan, plan_launch
from deepshard.launcher._ranks import check_script, prepare_log_files
from deepshard.launcher._report import REPORT_MARK, describe_outcome
from deepshard.launcher._specs import ProcessSpec
from deepshard.launcher._supervisor import supervise
from deepshard.launcher._watchdog_notice import watchdog_notice
from deepshard.launcher._world import WorldLayout

__all__ = ["describe_plan", "launch"]


def _rank_range(layout: WorldLayout, node_rank: int) -> str:
    first = layout.first_rank(node_rank)
    last = first + len(layout.nodes[node_rank].slots) - 1
    return f"rank {first}" if first == last else f"ranks {first}-{last}"


def _shell_line(spec: ProcessSpec) -> str:
    assignments = [f"{name}={shlex.quote(value)}" for name, value in spec.shown_env]
    return " ".join([*assignments, shlex.join(spec.argv)])


def describe_plan(plan: LaunchPlan) -> str:
    """What ``--dry_run`` prints: per node its ranks and slots, then every command.

    Each command is a shell line (the variables the launcher sets, then the quoted argv) that
    runs exactly what the launch would start.
    """
    layout = plan.layout
    lines = [
        f"{REPORT_MARK}dry run: launcher {plan.backend}, {layout.num_nodes} "
        f"node{'s' if layout.num_nodes != 1 else ''}, world size {layout.world_size}, "
        f"rendezvous {plan.rendezvous}",
    ]
    for note in plan.notes:
        lines.append(f"{REPORT_MARK}{note}")
    for node_rank, node in enumerate(layout.nodes):
        slots = ",".join(str(slot) for slot in node.slots)
        lines.append(
            f"node {node_rank} {node.host}: {_rank_range(layout, node_rank)}, slots {slots}"
        )
    lines.append(f"accelerators here: {plan.accelerators.kind} ({plan.accelerators.source})")
    for spec in plan.specs:
        lines.append(f"{spec.label}:")
        lines.append(f"  {_shell_line(spec)}")
        if spec.cpus is not None:
            lines.append(f"  pinned to CPUs {','.join(map(str, spec.cpus))}")
        if spec.log_path is not None:
            lines.append(f"  output to {spec.log_path}")
    return "\n".join(lines) + "\n"


def _report(outcome_text: str, err: TextIO) -> None:
    if outcome_text:
        err.write(outcome_text)
        err.flush()


def _attempt(
    plan: LaunchPlan, restart_count: int, log_dir: str | None, err: TextIO
) -> tuple[int, bool]:
    """Run one attempt; ``(exit code, whether a restart may follow)``."""
    for note in plan.notes:
        err.write(f"{REPORT_MARK}{note}\n")
    if plan.runs_ranks_here:
        prepare_log_files(list(plan.specs), restart_count)
    elif plan.backend == "slurm" and log_dir is not None:  # srun writes there, but cannot mkdir
        try:
            os.makedirs(log_dir, exist_ok=True)
        except OSError as error:
            raise LaunchError(f"cannot create --log_dir {log_dir!r}: {error}") from error
    outcome = supervise(plan.specs, plan.policy)
    # A node's own entry already reported which of its ranks failed; do not repeat its lines.
    repeated = any(line.startswith(REPORT_MARK) for line in outcome.tail)
    _report(describe_outcome(outcome, show_tail=not repeated), err)
    # A hang report reaches us in the rank's output, or (relayed ranks) in its error file.
    reported = [line for _, error in outcome.errors for line in error.message.splitlines()]
    _report(watchdog_notice([*outcome.tail, *reported]), err)
    return outcome.exit_code, outcome.received_signal is None and outcome.exit_code != 0


def launch(
    options: LaunchOptions,
    *,
    environ: dict[str, str],
    cwd: str,
    home: str,
    python: str,
    dry_run: bool,
    out: TextIO,
    err: TextIO,
) -> int:
    """Plan and run the job, restarting it up to ``options.max_restarts`` times on failure.

    Args:
        options: The user's choices.
        environ: The launcher's environment.
        cwd: The launch directory.
        home: The home directory.
        python: The Python executable of the ranks.
        dry_run: Print the plan (`describe_plan`) and start nothing.
        out: Where the dry run is printed.
        err: Where the launcher's own messages go.

    Returns:
        The exit code: 0, the first failed process's code (``128 + N`` for signal ``N``), or
        ``128 + N`` when ``ds-launch`` itself received signal ``N``.

    Raises:
        LaunchError: The options, hostfile or environment are inconsistent, the script does not
            exist, or a process could not be started.
    """
    restart_count = 0
    while True:
        plan = plan_launch(
            options,
            environ=environ,
            cwd=cwd,
            home=home,
            python=python,
            restart_count=restart_count,
        )
        if dry_run:
            out.write(describe_plan(plan))
            return 0
        if plan.runs_ranks_here:  # remote node entries check on their node
            check_script(options.run, cwd)
        code, may_restart = _attempt(plan, restart_count, options.run.log_dir, err)
        # an elastic job's restarts are its agents' (torchrun --max_restarts), not ours
        limit = 0 if options.elastic is not None else options.max_restarts
        if not may_restart or restart_count >= limit:
            return code
        restart_count += 1
        err.write(
            f"{REPORT_MARK}restarting the job (restart {restart_count} of "
            f"{options.max_restarts}, DEEPSHARD_RESTART_COUNT={restart_count})\n"
        )
        err.flush()
