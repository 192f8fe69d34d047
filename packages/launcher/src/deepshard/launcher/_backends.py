"""The processes each backend starts, given the resolved layout and rendezvous.

One builder per backend returns the `ProcessSpec` list and the `SupervisionPolicy`:
the ranks themselves (``local``, ``no_ssh``), one ssh client per node (``ssh``; ``torchrun``
across nodes), or one pdsh/srun/mpirun/torchrun process. See `deepshard.launcher._remote`
and `deepshard.launcher._schedulers` for the commands.
"""

from __future__ import annotations

import dataclasses
import secrets
import signal
from collections.abc import Mapping
from typing import TYPE_CHECKING

from deepshard.launcher._devices import Accelerators
from deepshard.launcher._elastic import elastic_torchrun_args
from deepshard.launcher._env import exported_variables
from deepshard.launcher._ports import is_local_address
from deepshard.launcher._ranks import NodeRun, node_rank_specs, torchrun_spec
from deepshard.launcher._remote import NodeEntry, pdsh_argv, pdsh_stop_argv, ssh_argv
from deepshard.launcher._schedulers import mpirun_argv, srun_argv
from deepshard.launcher._specs import ProcessSpec, SupervisionPolicy
from deepshard.launcher._world import WorldLayout

if TYPE_CHECKING:  # _plan imports this module
    from deepshard.launcher._plan import LaunchOptions

__all__ = ["BUILDERS", "BackendContext"]

# srun and pdsh answer one SIGINT with a status report (a second within a second aborts).
_INTERRUPT_AS_TERM = ((int(signal.SIGINT), int(signal.SIGTERM)),)


@dataclasses.dataclass(frozen=True)
class BackendContext:
    """What every backend builder needs.

    Attributes:
        options: The user's choices.
        layout: The filtered layout.
        accelerators: This machine's accelerators.
        environ: The launcher's environment.
        extra: Variables added for every rank (``.deepshard_env``, the restart count).
        cwd: The launch directory.
        python: The ranks' Python executable.
        addr: The rendezvous host (``""`` for slurm without ``--master_addr``).
        port: The rendezvous port (``0`` for slurm without ``--master_port``).
    """

    options: LaunchOptions
    layout: WorldLayout
    accelerators: Accelerators
    environ: Mapping[str, str]
    extra: Mapping[str, str]
    cwd: str
    python: str
    addr: str
    port: int

    def node_run(self, node_rank: int) -> NodeRun:
        """Node ``node_rank``'s part of the job, run by this process."""
        environ = {**self.environ, **self.extra}
        return NodeRun(
            self.layout,
            node_rank,
            self.addr,
            self.port,
            self.options.run,
            environ,
            self.accelerators,
            self.python,
        )

    def entry(self, *, torchrun: bool = False, job_id: str | None = None) -> NodeEntry:
        """What every remote node entry is told."""
        options = self.options
        return NodeEntry(
            self.layout,
            self.addr,
            self.port,
            options.run,
            self.python,
            self.cwd,
            {**exported_variables(self.environ), **self.extra},
            torchrun=torchrun,
            torchrun_args=options.launcher_args if torchrun else "",
            venv_script=options.venv_script,
            job_id=job_id,
        )


_Built = tuple[list[ProcessSpec], SupervisionPolicy]


def _local(context: BackendContext, pool: Mapping[str, int]) -> _Built:
    return node_rank_specs(context.node_run(0)), SupervisionPolicy()


def _no_ssh(context: BackendContext, pool: Mapping[str, int]) -> _Built:
    node_rank = context.options.node_rank
    assert node_rank is not None  # checked by _backend
    return node_rank_specs(context.node_run(node_rank)), SupervisionPolicy()


def _ssh_specs(context: BackendContext, entry: NodeEntry) -> list[ProcessSpec]:
    options = context.options
    return [
        ProcessSpec(
            label=f"node {rank} ({node.host}, over ssh)",
            argv=tuple(
                ssh_argv(
                    entry, rank, ssh_port=options.ssh_port, launcher_args=options.launcher_args
                )
            ),
            env=dict(context.environ),
            stop_mode="stdin",
        )
        for rank, node in enumerate(context.layout.nodes)
    ]


def _ssh(context: BackendContext, pool: Mapping[str, int]) -> _Built:
    return _ssh_specs(context, context.entry()), SupervisionPolicy()


def _torchrun(context: BackendContext, pool: Mapping[str, int]) -> _Built:
    layout, options = context.layout, context.options
    if options.elastic is not None:  # the agents' own arguments come first, the user's win
        elastic = elastic_torchrun_args(
            options.elastic,
            addr=context.addr,
            port=context.port,
            max_restarts=options.max_restarts,
            num_nodes=layout.num_nodes,
        )
        joined = f"{elastic} {options.launcher_args}".strip()
        context = dataclasses.replace(
            context, options=dataclasses.replace(options, launcher_args=joined)
        )
    if layout.num_nodes == 1 and is_local_address(layout.nodes[0].host):
        return [
            torchrun_spec(context.node_run(0), context.options.launcher_args)
        ], SupervisionPolicy()
    entry = context.entry(torchrun=True)
    # --launcher_args go to torchrun here, not to ssh.
    options = dataclasses.replace(context.options, launcher_args="")
    return _ssh_specs(dataclasses.replace(context, options=options), entry), SupervisionPolicy()


def _pdsh(context: BackendContext, pool: Mapping[str, int]) -> _Built:
    options = context.options
    entry = context.entry(job_id=secrets.token_hex(8))
    env = {**context.environ, "PDSH_RCMD_TYPE": "ssh"}
    if options.ssh_port is not None:
        env["PDSH_SSH_ARGS_APPEND"] = (
            f"{env.get('PDSH_SSH_ARGS_APPEND', '')} -p {options.ssh_port}".strip()
        )
    spec = ProcessSpec(
        label=f"pdsh on {', '.join(node.host for node in context.layout.nodes)}",
        argv=tuple(pdsh_argv(entry, launcher_args=options.launcher_args)),
        env=env,
        shown_env=(("PDSH_RCMD_TYPE", "ssh"),),
        signal_map=_INTERRUPT_AS_TERM,
    )

    def stop(signum: int) -> list[str]:
        return list(pdsh_stop_argv(entry, signum, launcher_args=options.launcher_args))

    return [spec], SupervisionPolicy(stop_command=stop)


def _slurm(context: BackendContext, pool: Mapping[str, int]) -> _Built:
    options = context.options
    shown = dict(context.extra)
    if options.master_addr:
        shown["MASTER_ADDR"] = options.master_addr
    if options.master_port:
        shown["MASTER_PORT"] = str(options.master_port)
    argv = srun_argv(
        context.layout,
        options.run,
        python=context.python,
        name_hosts=list(pool) != [node.host for node in context.layout.nodes],
        gpus_per_node=options.num_gpus,
        launcher_args=options.launcher_args,
    )
    spec = ProcessSpec(
        label="srun",
        argv=tuple(argv),
        env={**context.environ, **shown},
        shown_env=tuple(shown.items()),
        signal_map=_INTERRUPT_AS_TERM,
    )
    return [spec], SupervisionPolicy()


def _openmpi(context: BackendContext, pool: Mapping[str, int]) -> _Built:
    exports = {
        **exported_variables(context.environ),
        **context.extra,
        "MASTER_ADDR": context.addr,
        "MASTER_PORT": str(context.port),
    }
    argv = mpirun_argv(
        context.layout,
        context.options.run,
        python=context.python,
        exports=exports,
        launcher_args=context.options.launcher_args,
    )
    return [ProcessSpec(label="mpirun", argv=tuple(argv), env=dict(context.environ))], (
        SupervisionPolicy()
    )


BUILDERS = {
    "local": _local,
    "no_ssh": _no_ssh,
    "ssh": _ssh,
    "pdsh": _pdsh,
    "slurm": _slurm,
    "openmpi": _openmpi,
    "torchrun": _torchrun,
}
