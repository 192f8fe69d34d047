"""The node entry: what ``ds-launch`` runs on every node of a multi-node job.

``ds-launch`` (ssh, pdsh and torchrun backends) starts, on each node::

    cd <launch dir> && exec env <exported variables> PATH=<python's dir>:"$PATH" \\
        <python> -u -m deepshard.launcher.node --world=<layout> --node_rank=<k> \\
        --master_addr=<addr> --master_port=<port> [options] script.py args...

The node entry decodes the world layout (`WorldLayout.encode`), finds its node by
``--node_rank`` (ssh) or by ``--node_host`` (pdsh passes each node its own name), detects the
node's accelerators, and starts and supervises the node's ranks exactly as a local launch does:
same environment, same failure handling, same ``--log_dir`` files. With ``--torchrun`` it
supervises one PyTorch elastic agent instead.

It is stopped in three ways besides its ranks failing: a signal (SIGINT/SIGTERM/SIGHUP, passed
on to the ranks); with ``--watch_stdin``, a ``stop N`` line or EOF on its stdin (the launcher
closed the ssh session, or died and the connection dropped); with ``--job_id``, the command
``python -m deepshard.launcher.node --stop_job=<id> --signal=N`` run on the node (what pdsh,
which forwards no stdin, uses), which signals every node entry of that job through the pid
files they keep in the temporary directory.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import sys
import tempfile
from collections.abc import Iterator, Sequence

from deepshard.interface.errors import LaunchError
from deepshard.launcher._devices import detect_accelerators
from deepshard.launcher._ranks import (
    RESTART_COUNT_ENV,
    NodeRun,
    RunOptions,
    check_script,
    node_rank_specs,
    prepare_log_files,
    torchrun_spec,
)
from deepshard.launcher._report import REPORT_MARK, describe_outcome
from deepshard.launcher._supervisor import supervise
from deepshard.launcher._world import WorldLayout

__all__ = ["main", "stop_job"]

_JOB_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m deepshard.launcher.node",
        description="Start and supervise one node's ranks (run by ds-launch on each node).",
    )
    parser.add_argument("--world", help="the encoded world layout")
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--node_rank", type=int, help="this node's position in the layout")
    where.add_argument("--node_host", help="this node's host name in the layout")
    parser.add_argument("--master_addr", help="rendezvous host")
    parser.add_argument("--master_port", type=int, help="rendezvous port")
    for flag in ("--module", "--no_python", "--no_local_rank", "--bind_cores_to_rank"):
        parser.add_argument(flag, action="store_true")
    parser.add_argument("--bind_core_list")
    parser.add_argument("--log_dir")
    parser.add_argument("--torchrun", action="store_true", help="run torchrun's agent instead")
    parser.add_argument("--launcher_args", default="", help="extra torchrun arguments")
    parser.add_argument("--watch_stdin", action="store_true", help="stop on 'stop N' or EOF")
    parser.add_argument("--job_id", help="keep a pid file so that --stop_job can find us")
    parser.add_argument("--stop_job", help="signal every node entry of this job, then exit")
    parser.add_argument("--signal", type=int, default=15, help="the signal --stop_job sends")
    parser.add_argument("script", nargs="?", help="the training script or module")
    parser.add_argument("script_args", nargs=argparse.REMAINDER)
    return parser


def _job_dir(job_id: str) -> str:
    if not _JOB_ID.fullmatch(job_id):
        raise LaunchError(f"job id {job_id!r} must be 1-64 letters, digits, '_' or '-'")
    return os.path.join(tempfile.gettempdir(), f"deepshard-launch-{job_id}")


@contextlib.contextmanager
def _pid_file(job_id: str | None, node_rank: int) -> Iterator[None]:
    if job_id is None:
        yield
        return
    directory = _job_dir(job_id)
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"node-{node_rank}.pid")
    with open(path, "w", encoding="ascii") as handle:
        handle.write(str(os.getpid()))
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            os.remove(path)
        with contextlib.suppress(OSError):
            os.rmdir(directory)


def _runs_job(pid: int, job_id: str) -> bool:
    """Whether ``pid`` is still a node entry of ``job_id`` (a recycled pid is not)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as handle:
            return f"--job_id={job_id}".encode() in handle.read().split(b"\0")
    except FileNotFoundError:
        return not os.path.isdir("/proc/self")  # no /proc: trust the pid file
    except OSError:
        return False


def stop_job(job_id: str, signum: int) -> int:
    """Send ``signum`` to every node entry of ``job_id`` on this machine.

    Returns:
        How many node entries were signalled.

    Raises:
        LaunchError: ``job_id`` is malformed.
    """
    directory = _job_dir(job_id)
    signalled = 0
    with contextlib.suppress(OSError):
        for name in sorted(os.listdir(directory)):
            with contextlib.suppress(OSError, ValueError):
                with open(os.path.join(directory, name), encoding="ascii") as handle:
                    pid = int(handle.read().strip())
                if _runs_job(pid, job_id):
                    os.kill(pid, signum)
                    signalled += 1
    return signalled


def _run(args: argparse.Namespace) -> int:
    if args.world is None or args.master_addr is None or args.master_port is None:
        raise LaunchError("the node entry needs --world, --master_addr and --master_port")
    if args.script is None:
        raise LaunchError("the node entry needs the script to run")
    layout = WorldLayout.decode(args.world)
    node_rank = args.node_rank if args.node_host is None else layout.node_rank_of(args.node_host)
    if node_rank is None or not 0 <= node_rank < layout.num_nodes:
        raise LaunchError(f"--node_rank must be in 0..{layout.num_nodes - 1}, got {node_rank}")
    options = RunOptions(
        script=args.script,
        script_args=tuple(args.script_args),
        module=args.module,
        no_python=args.no_python,
        no_local_rank=args.no_local_rank,
        bind_cores_to_rank=args.bind_cores_to_rank,
        bind_core_list=args.bind_core_list,
        log_dir=args.log_dir,
    )
    run = NodeRun(
        layout,
        node_rank,
        args.master_addr,
        args.master_port,
        options,
        dict(os.environ),
        detect_accelerators(os.environ),
        sys.executable,
    )
    check_script(options, os.getcwd())
    specs = [torchrun_spec(run, args.launcher_args)] if args.torchrun else node_rank_specs(run)
    prepare_log_files(specs, int(os.environ.get(RESTART_COUNT_ENV, "0") or 0))
    with _pid_file(args.job_id, node_rank):
        outcome = supervise(specs, control=sys.stdin.buffer if args.watch_stdin else None)
    report = describe_outcome(outcome)
    if report and outcome.received_signal is None:
        sys.stderr.write(report)
        sys.stderr.flush()
    return outcome.exit_code


def main(argv: Sequence[str] | None = None) -> int:
    """Run the node entry (see the module docstring).

    Args:
        argv: Arguments without the program name (default: ``sys.argv[1:]``).

    Returns:
        The exit code: that of the first failed rank, ``128 + N`` after signal ``N``, else 0.
    """
    args = _parser().parse_args(argv)
    try:
        if args.stop_job is not None:
            stop_job(args.stop_job, args.signal)
            return 0
        return _run(args)
    except LaunchError as error:
        where = "" if args.node_host is None else f" on {args.node_host}"
        sys.stderr.write(f"{REPORT_MARK}error{where}: {error}\n")
        return 1


if __name__ == "__main__":
    sys.exit(main())
