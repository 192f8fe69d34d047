"""From the user's options to the processes ``ds-launch`` starts: the launch plan.

`plan_launch` reads the hostfile (or this machine's accelerators), applies the filters, picks
the backend and the rendezvous, and builds the `ProcessSpec` of every process the launcher
itself starts: the ranks (local launch, ``--no_ssh``), one ssh client per node, or the one
pdsh/srun/mpirun/torchrun command. It starts nothing, so ``--dry_run`` prints exactly what a
real launch would run.

Backend choice: ``--no_ssh`` runs only node ``--node_rank`` of the hostfile's layout here;
``--launcher NAME`` is used as asked (also for a single host); otherwise one host that is this
machine (or no hostfile at all) is a local launch, anything else goes over ssh.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping

from deepshard.interface.errors import LaunchError
from deepshard.launcher._backends import BUILDERS, BackendContext
from deepshard.launcher._devices import Accelerators, detect_accelerators
from deepshard.launcher._elastic import ElasticNodes
from deepshard.launcher._env import env_file_names, read_env_files
from deepshard.launcher._hostfile import DEFAULT_HOSTFILE, parse_hostfile
from deepshard.launcher._ports import (
    DEFAULT_MASTER_PORT,
    check_master_addr,
    is_local_address,
    resolve_master_port,
)
from deepshard.launcher._ranks import RESTART_COUNT_ENV, RunOptions
from deepshard.launcher._resources import parse_resource_spec, resolve_resources
from deepshard.launcher._specs import ProcessSpec, SupervisionPolicy
from deepshard.launcher._world import WorldLayout

__all__ = ["BACKENDS", "LaunchOptions", "LaunchPlan", "plan_launch"]

BACKENDS = ("ssh", "pdsh", "slurm", "openmpi", "torchrun")
"""The multi-node launchers ``--launcher`` accepts."""
_LOCAL_HOST = "localhost"


@dataclasses.dataclass(frozen=True)
class LaunchOptions:
    """Everything the user asked ``ds-launch`` for (one field per command-line flag).

    Attributes:
        run: What every rank runs.
        hostfile: ``--hostfile``, or ``None`` for the default ``/job/hostfile`` if it exists.
        include: ``--include`` filter.
        exclude: ``--exclude`` filter.
        num_nodes: ``--num_nodes``.
        num_gpus: ``--num_gpus``/``--num_accelerators``.
        nproc_per_node: ``--nproc_per_node``.
        master_addr: ``--master_addr``.
        master_port: ``--master_port`` (``None``: 29500; ``0``: a free port).
        launcher: ``--launcher`` (one of `BACKENDS`), or ``None`` to choose.
        launcher_args: ``--launcher_args``, passed to ssh/pdsh/srun/mpirun/torchrun.
        ssh_port: ``--ssh_port``.
        max_restarts: ``--max_restarts``.
        no_ssh: ``--no_ssh``: run only node ``node_rank`` of the layout, here.
        node_rank: ``--node_rank`` (with ``no_ssh``).
        venv_script: ``--venv_script``, sourced on remote nodes first.
        elastic: ``--elastic_training`` with its node range (`deepshard.launcher._elastic`),
            or ``None`` for a fixed job.
    """

    run: RunOptions
    hostfile: str | None = None
    include: str = ""
    exclude: str = ""
    num_nodes: int | None = None
    num_gpus: int | None = None
    nproc_per_node: int | None = None
    master_addr: str | None = None
    master_port: int | None = None
    launcher: str | None = None
    launcher_args: str = ""
    ssh_port: int | None = None
    max_restarts: int = 0
    no_ssh: bool = False
    node_rank: int | None = None
    venv_script: str | None = None
    elastic: ElasticNodes | None = None

    def __post_init__(self) -> None:
        counts = (
            ("--num_nodes", self.num_nodes),
            ("--num_gpus", self.num_gpus),
            ("--nproc_per_node", self.nproc_per_node),
        )
        for flag, count in counts:
            if count is not None and count < 1:
                raise LaunchError(
                    f"{flag} must be at least 1, got {count}; leave it out for the default"
                )


@dataclasses.dataclass(frozen=True)
class LaunchPlan:
    """What one launch attempt starts.

    Attributes:
        backend: ``"local"``, ``"no_ssh"``, or one of `BACKENDS`.
        layout: Every node's slots.
        rendezvous: ``"addr:port"`` as the ranks will see it (for messages).
        specs: The processes this launcher starts.
        policy: How they are supervised.
        accelerators: This machine's accelerators.
        notes: Things the user should know (e.g. a replaced port).
    """

    backend: str
    layout: WorldLayout
    rendezvous: str
    specs: tuple[ProcessSpec, ...]
    policy: SupervisionPolicy
    accelerators: Accelerators
    notes: tuple[str, ...] = ()

    @property
    def runs_ranks_here(self) -> bool:
        """Whether the specs are ranks (so their log files are prepared here)."""
        return self.backend in ("local", "no_ssh")


def _slots_flag(options: LaunchOptions) -> int | None:
    if None not in (options.num_gpus, options.nproc_per_node) and (
        options.num_gpus != options.nproc_per_node
    ):
        raise LaunchError(
            f"--num_gpus {options.num_gpus} and --nproc_per_node {options.nproc_per_node} "
            "disagree; they mean the same thing, pass one"
        )
    return options.num_gpus if options.num_gpus is not None else options.nproc_per_node


def _cpu_slots(options: LaunchOptions) -> int:
    """How many CPU ranks this machine offers without a hostfile: as many as asked for.

    A CPU slot is just a rank's index, so ``--include localhost:0,1`` asks for two ranks like
    ``--num_gpus 2`` does; a filter naming other hosts fails later, naming them.
    """
    if options.include:
        named = parse_resource_spec(options.include, "--include").get(_LOCAL_HOST)
        if named:
            return max(named) + 1
    return _slots_flag(options) or 1


def _pool(options: LaunchOptions, accelerators: Accelerators) -> tuple[dict[str, int], bool]:
    """``({host: slots}, from a hostfile)``; without one, this machine alone."""
    path = options.hostfile or DEFAULT_HOSTFILE
    if os.path.isfile(path):
        return parse_hostfile(path), True
    if options.hostfile is not None:
        raise LaunchError(
            f"hostfile {options.hostfile!r} does not exist; create it ('HOST slots=N' per "
            "line) or drop --hostfile to launch on this machine"
        )
    if accelerators.count:
        return {_LOCAL_HOST: accelerators.count}, False
    return {_LOCAL_HOST: _cpu_slots(options)}, False


def _backend(options: LaunchOptions, layout: WorldLayout, from_hostfile: bool) -> str:
    if options.elastic is not None:
        if options.no_ssh or options.launcher not in (None, "torchrun"):
            raise LaunchError(
                "--elastic_training runs PyTorch's elastic agent (--launcher torchrun); drop "
                "--no_ssh/--launcher (start one ds-launch per node with the same --master_addr "
                "and --master_port, or list the nodes in a hostfile)"
            )
        return "torchrun"
    if options.no_ssh:
        if options.node_rank is None or not 0 <= options.node_rank < layout.num_nodes:
            raise LaunchError(
                f"--no_ssh needs --node_rank in 0..{layout.num_nodes - 1} (this node's line "
                f"in the hostfile), got {options.node_rank}"
            )
        return "no_ssh"
    if options.launcher is not None:
        if options.launcher in ("ssh", "pdsh") and not from_hostfile:
            raise LaunchError(
                f"--launcher {options.launcher} needs a hostfile naming the hosts (--hostfile)"
            )
        return options.launcher
    single_local = layout.num_nodes == 1 and is_local_address(layout.nodes[0].host)
    return "local" if single_local else "ssh"


def _check_backend_options(backend: str, options: LaunchOptions) -> None:
    run = options.run
    binds = run.bind_cores_to_rank or run.bind_core_list is not None
    if backend == "openmpi" and (options.include or options.exclude):
        raise LaunchError(
            "the openmpi launcher cannot honour --include/--exclude (mpirun places ranks by "
            "count); edit the hostfile, or use --num_nodes/--num_gpus"
        )
    if backend in ("slurm", "openmpi", "torchrun") and binds:
        raise LaunchError(
            f"--bind_cores_to_rank is not available with --launcher {backend}; use its own "
            "binding through --launcher_args (srun --cpu-bind, mpirun --bind-to)"
        )
    if backend in ("openmpi", "torchrun") and run.log_dir is not None:
        raise LaunchError(
            f"--log_dir is not available with --launcher {backend}; pass its own output "
            "options through --launcher_args"
        )


def _master_addr(options: LaunchOptions, layout: WorldLayout, backend: str) -> str:
    if options.master_addr:
        # Under mpirun, rank 0's host may be a name only the cluster's nodes know.
        check_master_addr(options.master_addr, resolve=backend != "openmpi")
        return options.master_addr
    hosts = [node.host for node in layout.nodes]
    loopback = [host == _LOCAL_HOST or host.startswith("127.") for host in hosts]
    if all(loopback) or backend == "local":
        return "127.0.0.1"
    if loopback[0]:
        raise LaunchError(
            f"rank 0 runs on {hosts[0]!r}, which other nodes cannot reach; pass --master_addr "
            "with an address of that host that the other nodes can use"
        )
    return hosts[0]


def _rendezvous(
    options: LaunchOptions, layout: WorldLayout, backend: str
) -> tuple[str, int, str | None]:
    addr = _master_addr(options, layout, backend)
    if backend == "no_ssh" or options.elastic is not None:  # each node picks it alone
        port = DEFAULT_MASTER_PORT if options.master_port is None else options.master_port
        if not 1 <= port <= 65535:
            raise LaunchError(f"--master_port must be in 1-65535 here, got {port}")
        return addr, port, None
    port, note = resolve_master_port(addr, options.master_port)
    return addr, port, note


def plan_launch(
    options: LaunchOptions,
    *,
    environ: Mapping[str, str],
    cwd: str,
    home: str,
    python: str,
    restart_count: int = 0,
) -> LaunchPlan:
    """Work out what to start for one attempt (see the module docstring).

    Args:
        options: The user's choices.
        environ: The launcher's environment.
        cwd: The launch directory (remote nodes ``cd`` here; its ``.deepspeed_env`` and
            ``.deepshard_env`` are read here).
        home: The home directory (its environment files are read first).
        python: The Python executable of the ranks (the same path on every node).
        restart_count: How many restarts came before (``DEEPSHARD_RESTART_COUNT``).

    Returns:
        The plan; nothing has been started.

    Raises:
        LaunchError: Any inconsistency in the options, hostfile, filters or environment.
    """
    accelerators = detect_accelerators(environ)
    pool, from_hostfile = _pool(options, accelerators)
    resources = resolve_resources(
        pool,
        include=options.include,
        exclude=options.exclude,
        num_nodes=options.num_nodes,
        num_slots=_slots_flag(options),  # without a hostfile on CPU the pool is this already
    )
    layout = WorldLayout.from_resources(resources)
    backend = _backend(options, layout, from_hostfile)
    _check_backend_options(backend, options)
    if backend == "slurm":
        if options.master_addr:  # srun places rank 0: its name may be unknown here
            check_master_addr(options.master_addr, resolve=False)
        addr, port, note = options.master_addr or "", options.master_port or 0, None
    else:
        addr, port, note = _rendezvous(options, layout, backend)
    files = read_env_files([home, cwd], env_file_names(environ))
    extra = {**files, RESTART_COUNT_ENV: str(restart_count)}
    context = BackendContext(options, layout, accelerators, environ, extra, cwd, python, addr, port)
    specs, policy = BUILDERS[backend](context, pool)
    rendezvous = f"{addr}:{port}" if backend != "slurm" else _slurm_rendezvous(options)
    notes = (note,) if note else ()
    return LaunchPlan(backend, layout, rendezvous, tuple(specs), policy, accelerators, notes)


def _slurm_rendezvous(options: LaunchOptions) -> str:
    addr = options.master_addr or "first node of the step"
    port = options.master_port or "10000 + SLURM_JOB_ID % 20000"
    return f"{addr}:{port}"
