"""The ``ds-launch`` command line.

Flags follow DeepSpeed's ``deepspeed`` launcher (``--hostfile``, ``--include``, ``--num_gpus``,
``--launcher``, ...) and torchrun's (``--nproc_per_node``, ``--master_port``,
``--max_restarts``, ``-m``). Only the standard library is imported until the arguments are
parsed, so ``ds-launch --help`` answers at once; nothing here ever imports torch.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from deepshard.launcher._plan import LaunchOptions

__all__ = ["build_parser", "main", "parse_args"]

_EPILOG = """\
examples:
  ds-launch --nproc_per_node 4 train.py --lr 3e-4      4 ranks on this machine
  ds-launch -m my_pkg.train                           a module, one rank per accelerator
  ds-launch -H hostfile -i worker-0:0,1@worker-1 train.py
  ds-launch -H hostfile --launcher slurm --dry_run train.py

environment: remote nodes receive the variables starting with NCCL, PYTHON, UCX, MLFLOW, HF_,
TORCH, DEEPSHARD and OMP_, VIRTUAL_ENV, and the KEY=VALUE lines of .deepspeed_env (or
$DS_ENV_FILE) and .deepshard_env in ~ and then . (later files win). Each rank gets RANK,
LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, LOCAL_SIZE, CROSS_RANK, CROSS_SIZE, MASTER_ADDR,
MASTER_PORT, DEEPSHARD_RESTART_COUNT and, on GPU nodes, CUDA_VISIBLE_DEVICES narrowed to its
node's slots.

hangs: DEEPSHARD_TIMEOUT (minutes, default 10) is the process-group timeout.
DEEPSHARD_WATCHDOG_S (seconds, default 120, 0 = off; config key comms_watchdog_s) bounds one
collective's wait: the waiting rank then reports which ranks have not arrived (op, shape, call
site) and fails, and ds-launch names those ranks.
"""


def _add_placement(parser: argparse.ArgumentParser) -> None:
    where = parser.add_argument_group("where the ranks run")
    add = where.add_argument
    add("-H", "--hostfile", help="'HOST slots=N' lines (default: /job/hostfile if it exists)")
    add("-i", "--include", default="", help="only these hosts/slots: 'worker-0:0,2@worker-1'")
    add("-e", "--exclude", default="", help="all but these hosts/slots")
    add("--num_nodes", type=int, help="use the first N hosts")
    add("--num_gpus", "--num_accelerators", type=int, help="use the first N slots of each host")
    add(
        "--nproc_per_node",
        "--nproc-per-node",
        type=int,
        help="ranks per node (default: one per accelerator, or 1 on CPU)",
    )
    add(
        "--no_ssh",
        action="store_true",
        help="start only this node's ranks (run ds-launch on every node)",
    )
    add("--node_rank", type=int, help="this node's position with --no_ssh")
    rendezvous = parser.add_argument_group("rendezvous")
    rendezvous.add_argument(
        "--master_addr",
        "--master-addr",
        help="host of rank 0 (default: 127.0.0.1 or the first host)",
    )
    rendezvous.add_argument(
        "--master_port",
        "--master-port",
        type=int,
        help="port of rank 0 (default 29500; 0 or a busy port: a free one)",
    )


def _add_backend(parser: argparse.ArgumentParser) -> None:
    backend = parser.add_argument_group("multi-node launcher")
    add = backend.add_argument
    add(
        "--launcher",
        type=str.lower,
        choices=("ssh", "pdsh", "slurm", "openmpi", "torchrun", *_MPI_LAUNCHERS),
        metavar="{ssh,pdsh,slurm,openmpi,torchrun}",
        help="how other nodes are reached (default: ssh when the hostfile names other hosts)",
    )
    add("--launcher_args", default="", help="extra ssh/pdsh/srun/mpirun/torchrun arguments")
    add(
        "--elastic_training",
        action="store_true",
        help="elastic job: torchrun agents in a c10d rendezvous re-form it when nodes come or go",
    )
    add("--min_elastic_nodes", type=int, help="elastic: fewest nodes the job runs with (1)")
    add("--max_elastic_nodes", type=int, help="elastic: most nodes (default: the hostfile's)")
    add("--ssh_port", type=int, help="ssh port of the remote nodes")
    add("--venv_script", help="script sourced on remote nodes before starting")
    add(
        "--no_ssh_check",
        action="store_true",
        help="DeepSpeed's flag, accepted: ds-launch never probes ssh before starting",
    )
    add(
        "--force_multi",
        action="store_true",
        help="DeepSpeed's flag, accepted: a remote host is always reached through the launcher, "
        "even when it is the only one",
    )


def _add_rank_options(parser: argparse.ArgumentParser) -> None:
    ranks = parser.add_argument_group("the ranks")
    add = ranks.add_argument
    add("-m", "--module", action="store_true", help="run the script as a module (python -m)")
    add("--no_python", action="store_true", help="execute the script itself, not with python")
    add("--no_local_rank", action="store_true", help="do not pass --local_rank=N to the script")
    add("--bind_cores_to_rank", action="store_true", help="pin each rank to its share of cores")
    add("--bind_core_list", help="cores to share out, e.g. 0-15,32-47 (implies binding)")
    add(
        "--max_restarts",
        "--max-restarts",
        type=int,
        default=0,
        help="restart the whole job up to K times after a failure",
    )
    add(
        "--log_dir",
        "--log-dir",
        "--enable_each_rank_log",
        help="write each rank's output to DIR/rank_<RANK>.log (--enable_each_rank_log: "
        "DeepSpeed's name)",
    )
    add(
        "--traceback",
        action="store_true",
        help="show the traceback of a DeepShard error instead of its message alone (as "
        "DEEPSHARD_TRACEBACK=1 does); without it, an error every rank raises prints once",
    )


_MPI_LAUNCHERS = ("mvapich", "mpich", "impi")
"""DeepSpeed's other MPI launchers, named in the refusal rather than as unknown choices."""


def _add_deepspeed_only(parser: argparse.ArgumentParser) -> None:
    """DeepSpeed launcher flags about the launcher itself, accepted so its commands run."""
    compat = parser.add_argument_group("accepted for DeepSpeed's command lines")
    add = compat.add_argument
    add(
        "--log_level",
        type=str.lower,
        choices=("debug", "info", "warning", "error", "critical"),
        help="DeepSpeed's launcher log level, accepted; ds-launch prints only its plan, "
        "restarts and errors",
    )
    add("-q", "--quiet", action="store_true", help="DeepSpeed's flag, accepted (as --log_level)")
    add(
        "--save_pid",
        action="store_true",
        help="DeepSpeed's flag: write this launcher's process id to /tmp/<pid>.deepshard "
        "(removed at exit)",
    )
    add("--autotuning", help="refused: ds-launch has no autotuner")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``ds-launch`` (standard library only)."""
    parser = argparse.ArgumentParser(
        prog="ds-launch",
        description="Start a DeepShard (or any torch.distributed) job on this machine or many.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_placement(parser)
    _add_backend(parser)
    _add_rank_options(parser)
    parser.add_argument(
        "--dry_run",
        action="store_true",
        help="print each node's ranks, slots and commands, and start nothing",
    )
    _add_deepspeed_only(parser)
    parser.add_argument("user_script", help="the training script (or module with -m)")
    parser.add_argument("user_args", nargs=argparse.REMAINDER, help="the script's arguments")
    return parser


def _join_launcher_args(parser: argparse.ArgumentParser, argv: Sequence[str]) -> list[str]:
    """``--launcher_args VALUE`` as ``--launcher_args=VALUE`` among ds-launch's own options.

    Its value usually starts with a dash (``-mca btl_tcp_if_include eth1``), which argparse
    would read as an option (``-m`` with ``ca`` attached). Only the options before the script
    are ds-launch's; the rest are the script's, so the scan stops at the first word that is
    not an option or an option's value.
    """
    takes_value = {
        flag for action in parser._actions if action.nargs != 0 for flag in action.option_strings
    }
    words = list(argv)
    index = 0
    while index < len(words) and words[index].startswith("-") and words[index] != "--":
        word = words[index]
        if word == "--launcher_args" and index + 1 < len(words):
            words[index : index + 2] = [f"{word}={words[index + 1]}"]
        elif word in takes_value:
            index += 1  # its value follows
        index += 1
    return words


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    """``ds-launch``'s arguments (``argv`` without the program name); exits on bad ones."""
    parser = build_parser()
    args = parser.parse_args(_join_launcher_args(parser, argv))
    _check_counts(parser, args)
    return args


def _check_counts(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.max_restarts < 0:
        parser.error(f"--max_restarts must be >= 0, got {args.max_restarts}")
    if args.ssh_port is not None and not 1 <= args.ssh_port <= 65535:
        parser.error(f"--ssh_port must be a port (1-65535), got {args.ssh_port}")
    elastic_counts = args.min_elastic_nodes is not None or args.max_elastic_nodes is not None
    if elastic_counts and not args.elastic_training:
        parser.error("--min_elastic_nodes/--max_elastic_nodes need --elastic_training")
    if args.node_rank is not None and not args.no_ssh:
        parser.error("--node_rank is only used with --no_ssh")
    if args.autotuning is not None:
        parser.error(
            "--autotuning: DeepShard does not carry DeepSpeed's autotuner; choose the batch "
            "size and ZeRO settings in the config (the flops_profiler and memory_breakdown keys "
            "help) and launch without --autotuning"
        )
    if args.launcher in _MPI_LAUNCHERS:
        parser.error(
            f"--launcher {args.launcher}: ds-launch starts MPI jobs with Open MPI's mpirun "
            "(--launcher openmpi) or with slurm; pass your MPI's extra options through "
            "--launcher_args"
        )


def _options(args: argparse.Namespace) -> LaunchOptions:
    from deepshard.launcher._elastic import ElasticNodes
    from deepshard.launcher._plan import LaunchOptions
    from deepshard.launcher._ranks import RunOptions

    run = RunOptions(
        script=args.user_script,
        script_args=tuple(args.user_args),
        module=args.module,
        no_python=args.no_python,
        no_local_rank=args.no_local_rank,
        bind_cores_to_rank=args.bind_cores_to_rank or args.bind_core_list is not None,
        bind_core_list=args.bind_core_list,
        log_dir=None if args.log_dir is None else os.path.abspath(args.log_dir),
    )
    return LaunchOptions(
        run=run,
        hostfile=args.hostfile,
        include=args.include,
        exclude=args.exclude,
        num_nodes=args.num_nodes,
        num_gpus=args.num_gpus,
        nproc_per_node=args.nproc_per_node,
        master_addr=args.master_addr,
        master_port=args.master_port,
        launcher=args.launcher,
        launcher_args=args.launcher_args,
        ssh_port=args.ssh_port,
        max_restarts=args.max_restarts,
        no_ssh=args.no_ssh,
        node_rank=args.node_rank,
        venv_script=args.venv_script,
        elastic=ElasticNodes(
            1 if args.min_elastic_nodes is None else args.min_elastic_nodes, args.max_elastic_nodes
        )
        if args.elastic_training
        else None,
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``ds-launch``.

    Args:
        argv: Arguments without the program name (default: ``sys.argv[1:]``).

    Returns:
        The exit code (see `deepshard.launcher.launch`); 1 for a DeepShard error (its message
        is printed, with its traceback under ``--traceback``), 2 for bad arguments.
    """
    args = parse_args(sys.argv[1:] if argv is None else argv)
    # Imported only now: they pull in deepshard.interface (pydantic), not needed for --help.
    from deepshard.interface.errors import DeepShardError
    from deepshard.launcher._launch import launch
    from deepshard.launcher._rank_errors import TRACEBACK_ENV, traceback_requested

    environ = dict(os.environ)
    if args.save_pid:
        _save_pid()
    if args.traceback:
        environ[TRACEBACK_ENV] = "1"  # the ranks (and remote nodes) read it
    try:
        return launch(
            _options(args),
            environ=environ,
            cwd=os.getcwd(),
            home=os.path.expanduser("~"),
            python=sys.executable,
            dry_run=args.dry_run,
            out=sys.stdout,
            err=sys.stderr,
        )
    except DeepShardError as error:
        if traceback_requested(environ):
            traceback.print_exc()
        sys.stderr.write(f"ds-launch: error: {error}\n")
        return 1


def _save_pid() -> None:
    """DeepSpeed's ``--save_pid``: the launcher's process id in a file named after it."""
    import atexit

    path = os.path.join("/tmp", f"{os.getpid()}.deepshard")
    with open(path, "w", encoding="utf-8") as handle:
        handle.write(f"{os.getpid()}\n")

    def remove() -> None:
        if os.path.exists(path):
            os.remove(path)

    atexit.register(remove)


if __name__ == "__main__":
    sys.exit(main())
