"""Commands for launchers that start every rank themselves: SLURM's ``srun`` and ``mpirun``.

The ranks are started directly by the scheduler and find their place through its variables
(``SLURM_PROCID``/``SLURM_LOCALID``/``SLURM_STEP_*`` or ``OMPI_COMM_WORLD_*``), which
``deepshard.comm.init_distributed`` reads. Neither can give one rank an argument of its own, so
the ranks get no ``--local_rank=N`` (they read the local rank from the environment), and
neither can pin ranks to particular slots, so filters they cannot express are refused before
anything starts:

- srun places tasks by count: ``-n`` is the number of slots left after filtering, with
  ``--ntasks-per-node`` (every node must keep the same number of slots) and ``--nodes``;
  ``--nodelist`` names the hosts when a filter dropped some; ``--gpus-per-node`` follows
  ``--num_gpus``. A filter that keeps other than the leading slots of a node, or unequal
  counts per node, is an error. ``--kill-on-bad-exit=1`` makes srun end the step when one
  task fails, and ``--export=ALL`` passes the launcher's environment (which includes the
  ``.deepshard_env`` variables) to every task without any quoting.
- mpirun runs ``--host HOST:SLOTS,...`` with ``-x NAME=VALUE`` for each exported variable;
  ``--include``/``--exclude`` are refused (Open MPI cannot honour slot lists),
  ``--num_nodes``/``--num_gpus`` are expressed through the host list.
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping

from deepshard.interface.errors import LaunchError
from deepshard.launcher._ranks import RunOptions, rank_argv
from deepshard.launcher._world import WorldLayout

__all__ = ["check_slurm_layout", "mpirun_argv", "srun_argv"]


def check_slurm_layout(layout: WorldLayout) -> int:
    """Refuse layouts srun cannot express; return the slots per node.

    Raises:
        LaunchError: A node keeps slots other than its leading ones, or nodes keep unequal
            numbers of slots.
    """
    for node in layout.nodes:
        if node.slots != tuple(range(len(node.slots))):
            raise LaunchError(
                f"the slurm launcher cannot choose slots {list(node.slots)} on {node.host}: "
                "srun places tasks by count, not by device; filter whole hosts, or keep the "
                "first N slots of every host (--num_gpus N)"
            )
    counts = {node.host: len(node.slots) for node in layout.nodes}
    if len(set(counts.values())) > 1:
        raise LaunchError(
            f"the slurm launcher needs the same number of slots on every host, got {counts}; "
            "use --num_gpus N or filter so that every host keeps the same count"
        )
    return len(layout.nodes[0].slots)


def srun_argv(
    layout: WorldLayout,
    options: RunOptions,
    *,
    python: str,
    name_hosts: bool,
    gpus_per_node: int | None,
    launcher_args: str,
) -> list[str]:
    """The ``srun`` command that starts every rank.

    Args:
        layout: The filtered layout (checked with `check_slurm_layout`).
        options: What each rank runs.
        python: The Python executable.
        name_hosts: Add ``--nodelist`` (a filter dropped hosts of the hostfile).
        gpus_per_node: ``--num_gpus``, or ``None``.
        launcher_args: Extra srun arguments, split like a shell.

    Raises:
        LaunchError: The layout cannot be expressed (see `check_slurm_layout`).
    """
    per_node = check_slurm_layout(layout)
    argv = [
        "srun",
        "-n",
        str(layout.world_size),
        f"--nodes={layout.num_nodes}",
        f"--ntasks-per-node={per_node}",
    ]
    if name_hosts:
        argv.append("--nodelist=" + ",".join(node.host for node in layout.nodes))
    if gpus_per_node is not None:
        argv.append(f"--gpus-per-node={gpus_per_node}")
    if options.log_dir is not None:
        argv.append(f"--output={options.log_dir}/rank_%t.log")
    argv += ["--kill-on-bad-exit=1", "--export=ALL", *shlex.split(launcher_args)]
    return [*argv, *rank_argv(options, python, None)]


def mpirun_argv(
    layout: WorldLayout,
    options: RunOptions,
    *,
    python: str,
    exports: Mapping[str, str],
    launcher_args: str,
) -> list[str]:
    """The ``mpirun`` (Open MPI) command that starts every rank.

    Args:
        layout: The layout (hosts and slot counts).
        options: What each rank runs.
        python: The Python executable.
        exports: Variables every rank receives (``-x NAME=VALUE``; no shell is involved).
        launcher_args: Extra mpirun arguments, split like a shell.
    """
    hosts = ",".join(f"{node.host}:{len(node.slots)}" for node in layout.nodes)
    argv = ["mpirun", "-n", str(layout.world_size), "--host", hosts, *shlex.split(launcher_args)]
    for name, value in exports.items():
        argv += ["-x", f"{name}={value}"]
    return [*argv, *rank_argv(options, python, None)]
