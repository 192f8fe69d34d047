"""What one node starts: its ranks (or, with ``--launcher torchrun``, one torchrun agent).

Shared by the local launch (run inside ``ds-launch``) and the node entry that ``ds-launch``
starts on every remote node, so both build exactly the same commands and environments.
"""

from __future__ import annotations

import dataclasses
import os
import shlex
from collections.abc import Mapping

from deepshard.interface.errors import LaunchError
from deepshard.launcher._cores import (
    SYSFS_CPU,
    available_cpus,
    core_groups,
    parse_core_list,
    split_cores,
)
from deepshard.launcher._devices import Accelerators
from deepshard.launcher._specs import ProcessSpec
from deepshard.launcher._world import WorldLayout, rank_environment

__all__ = [
    "RESTART_COUNT_ENV",
    "NodeRun",
    "RunOptions",
    "check_script",
    "node_rank_specs",
    "prepare_log_files",
    "rank_argv",
    "torchrun_spec",
]

RESTART_COUNT_ENV = "DEEPSHARD_RESTART_COUNT"
"""How many times the job was restarted before this attempt (0 on the first)."""

SCRIPT_RUNNER = "deepshard.launcher.script"
"""The module a rank's Python runs the script through (`deepshard.launcher.script`)."""


@dataclasses.dataclass(frozen=True)
class RunOptions:
    """What every rank runs, and how (the options that travel to each node).

    Attributes:
        script: The training script, or the module with ``module``.
        script_args: Its arguments.
        module: Run ``script`` as ``python -m script``.
        no_python: Execute ``script`` directly instead of through the Python interpreter.
        no_local_rank: Do not pass ``--local_rank=N`` to the script.
        bind_cores_to_rank: Pin each rank to its share of the node's cores.
        bind_core_list: The CPUs to share out instead of all available ones (``"0-3,8"``);
            giving it implies ``bind_cores_to_rank``.
        log_dir: Write each rank's output to ``log_dir/rank_<RANK>.log`` instead of relaying it.
    """

    script: str
    script_args: tuple[str, ...] = ()
    module: bool = False
    no_python: bool = False
    no_local_rank: bool = False
    bind_cores_to_rank: bool = False
    bind_core_list: str | None = None
    log_dir: str | None = None

    def __post_init__(self) -> None:
        if self.module and self.no_python:
            raise LaunchError("--module and --no_python cannot be combined: a module needs python")
        if self.bind_core_list is not None:
            parse_core_list(self.bind_core_list)  # fail early, on the launching machine


@dataclasses.dataclass(frozen=True)
class NodeRun:
    """Everything one node needs to start its part of the job.

    Attributes:
        layout: The job's layout.
        node_rank: Which node this is.
        master_addr: Rendezvous host.
        master_port: Rendezvous port.
        options: What every rank runs.
        environ: The base environment of every rank.
        accelerators: This node's accelerators (`detect_accelerators`).
        python: The Python executable that runs the ranks.
    """

    layout: WorldLayout
    node_rank: int
    master_addr: str
    master_port: int
    options: RunOptions
    environ: Mapping[str, str]
    accelerators: Accelerators
    python: str


def rank_argv(options: RunOptions, python: str, local_rank: int | None) -> list[str]:
    """The command of one rank (``local_rank=None``: without ``--local_rank``).

    Python runs the script through `deepshard.launcher.script`, which reports a DeepShard
    error once instead of as a traceback per rank. ``--local_rank=N`` comes after the script's
    own arguments, so a script that reads its arguments by position sees them where it put them
    (argparse does not mind the order).
    """
    if options.no_python:
        command = [options.script]
    elif options.module:
        command = [python, "-u", "-m", SCRIPT_RUNNER, "-m", options.script]
    else:
        command = [python, "-u", "-m", SCRIPT_RUNNER, options.script]
    command += options.script_args
    if local_rank is not None and not options.no_local_rank:
        command.append(f"--local_rank={local_rank}")
    return command


def _cpu_shares(
    options: RunOptions, ranks: int, cpus: list[int] | None, sysfs: str
) -> list[tuple[tuple[int, ...] | None, int]]:
    available = cpus if cpus is not None else available_cpus()
    if options.bind_cores_to_rank or options.bind_core_list is not None:
        listed = None if options.bind_core_list is None else parse_core_list(options.bind_core_list)
        shares = split_cores(ranks, core_list=listed, cpus=available, sysfs=sysfs)
        return [(share, count) for share, count in shares]
    return [(None, max(1, len(core_groups(available, sysfs)) // ranks))] * ranks


def node_rank_specs(
    run: NodeRun, *, cpus: list[int] | None = None, sysfs: str = SYSFS_CPU
) -> list[ProcessSpec]:
    """The ranks of node ``run.node_rank``, ready for `supervise`.

    Each rank's environment is ``run.environ`` plus `rank_environment`,
    ``DEEPSHARD_RESTART_COUNT`` (``0`` unless the environment has it), the accelerators'
    visible-devices variable narrowed to the node's slots (on a node with accelerators), and
    ``OMP_NUM_THREADS`` set to the rank's share of the cores unless the environment sets it
    (on a CPU node, or when binding cores).

    Args:
        run: The node's part of the job.
        cpus: The CPUs to share out (default: this process's affinity).
        sysfs: ``/sys/devices/system/cpu`` replacement for tests.

    Returns:
        One spec per local rank.

    Raises:
        LaunchError: A slot has no device, or the cores cannot be shared out.
    """
    layout, options, accelerators = run.layout, run.options, run.accelerators
    node = layout.nodes[run.node_rank]
    visible = accelerators.visible_value(node.slots, node.host) if accelerators.count else None
    shares = _cpu_shares(options, len(node.slots), cpus, sysfs)
    specs = []
    for local_rank, (share, threads) in enumerate(shares):
        shown = rank_environment(
            layout, run.node_rank, local_rank, run.master_addr, run.master_port
        )
        if visible is not None and accelerators.variable is not None:
            shown[accelerators.variable] = visible
        if "OMP_NUM_THREADS" not in run.environ and (not accelerators.count or share is not None):
            shown["OMP_NUM_THREADS"] = str(threads)
        env = {RESTART_COUNT_ENV: "0", **run.environ, **shown}
        rank = int(shown["RANK"])
        log = None if options.log_dir is None else os.path.join(options.log_dir, f"rank_{rank}.log")
        specs.append(
            ProcessSpec(
                label=f"rank {rank} (local rank {local_rank} on {node.host})",
                argv=tuple(rank_argv(options, run.python, local_rank)),
                env=env,
                prefix=f"[rank {rank}] ".encode() if layout.world_size > 1 else b"",
                log_path=log,
                cpus=share,
                shown_env=tuple(shown.items()),
                reports_errors=not options.no_python,
            )
        )
    return specs


def check_script(options: RunOptions, cwd: str) -> None:
    """Refuse a script file that does not exist, before any rank starts.

    A module (``--module``) or a command (``--no_python``, looked up on ``PATH``) is left to
    the rank to find.

    Raises:
        LaunchError: ``options.script`` is not a file relative to ``cwd``.
    """
    if options.module or options.no_python:
        return
    path = os.path.join(cwd, options.script)
    if not os.path.isfile(path):
        raise LaunchError(
            f"the script {options.script!r} does not exist (looked for {path}); check the "
            "path, or pass --module to run a module"
        )


def torchrun_spec(run: NodeRun, launcher_args: str = "") -> ProcessSpec:
    """PyTorch's elastic agent for node ``run.node_rank`` (``python -m torch.distributed.run``).

    torchrun sets each rank's ``RANK``/``LOCAL_RANK``/... itself and passes no
    ``--local_rank`` argument; the agent's environment adds DeepSpeed's ``CROSS_RANK``,
    ``CROSS_SIZE`` and ``LOCAL_SIZE``, and the node's visible devices.

    Args:
        run: The node's part of the job.
        launcher_args: Extra torchrun arguments (``--launcher_args``), split like a shell.
    """
    layout, options = run.layout, run.options
    node = layout.nodes[run.node_rank]
    shown = {
        "CROSS_RANK": str(run.node_rank),
        "CROSS_SIZE": str(layout.num_nodes),
        "LOCAL_SIZE": str(len(node.slots)),
    }
    if run.accelerators.count and run.accelerators.variable is not None:
        shown[run.accelerators.variable] = run.accelerators.visible_value(node.slots, node.host)
    mode = ["--no-python"] if options.no_python else ["-m"] if options.module else []
    argv = [
        run.python,
        "-m",
        "torch.distributed.run",
        f"--nnodes={layout.num_nodes}",
        f"--node_rank={run.node_rank}",
        f"--nproc_per_node={len(node.slots)}",
        f"--master_addr={run.master_addr}",
        f"--master_port={run.master_port}",
        *shlex.split(launcher_args),
        *mode,
        options.script,
        *options.script_args,
    ]
    return ProcessSpec(
        label=f"torchrun agent of node {run.node_rank} ({node.host})",
        argv=tuple(argv),
        env={RESTART_COUNT_ENV: "0", **run.environ, **shown},
        shown_env=tuple(shown.items()),
    )


def prepare_log_files(specs: list[ProcessSpec], restart_count: int) -> None:
    """Create the log directory; start fresh logs, or mark a restart in the existing ones.

    Raises:
        LaunchError: The directory or a file cannot be created.
    """
    for spec in specs:
        if spec.log_path is None:
            continue
        try:
            os.makedirs(os.path.dirname(spec.log_path) or ".", exist_ok=True)
            with open(spec.log_path, "w" if restart_count == 0 else "a", encoding="utf-8") as log:
                if restart_count:
                    log.write(f"===== ds-launch: restart {restart_count} =====\n")
        except OSError as error:
            raise LaunchError(f"cannot write the log of {spec.label}: {error}") from error
