"""Join the world: read the launcher's variables, bind the device, create the default group.

``init_distributed`` is the one place that touches ``torch.distributed``'s default process group
(PyTorch keeps it per process; DeepShard adds no state of its own). Everything else receives the
mesh that `deepshard.comm.build_mesh` makes from it.

The rendezvous is a ``TCPStore`` served by rank 0 at ``MASTER_ADDR:MASTER_PORT`` (or by
torchrun's agent when it says so through ``TORCHELASTIC_USE_AGENT_STORE``), built here rather than
through ``init_method="env://"`` so that the variables can come from any mapping, not only
``os.environ``.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from datetime import timedelta

import torch.distributed as dist

from deepshard.comm._launch_env import (
    LaunchEnv,
    read_launch_env,
    rendezvous_address,
    resolve_timeout,
)
from deepshard.interface.errors import CommError, ConfigError

__all__ = ["DistInfo", "init_distributed"]


@dataclasses.dataclass(frozen=True)
class DistInfo:
    """Where this process sits in the initialised world.

    Attributes:
        rank: Global rank.
        world_size: Number of processes.
        local_rank: Rank among the processes on this node (selects the device).
        local_world_size: Number of processes on this node.
        master_addr: Rendezvous host, or ``None`` if the group was created without one
            (e.g. through a FileStore) and the environment names none.
        master_port: Rendezvous port, or ``None`` likewise.
        backend: The default group's backend, e.g. ``"gloo"`` or ``"nccl"``.
    """

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str | None
    master_port: int | None
    backend: str


def _already_initialised(launch: LaunchEnv, backend: str | None) -> DistInfo:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    actual_backend = str(dist.get_backend())
    if launch.launcher != "none" and (launch.rank, launch.world_size) != (rank, world_size):
        raise CommError(
            f"the default process group is already initialised as rank {rank} of {world_size}, "
            f"but the {launch.launcher} environment says rank {launch.rank} of "
            f"{launch.world_size}; destroy the group or fix the launcher's variables"
        )
    if backend is not None and backend != actual_backend:
        raise CommError(
            f"the default process group is already initialised with backend "
            f"{actual_backend!r}, not the requested {backend!r}"
        )
    if launch.launcher == "none":  # no launcher variables: assume one node
        local_rank, local_world_size = rank, world_size
    else:
        local_rank, local_world_size = launch.local_rank, launch.local_world_size
    return DistInfo(
        rank,
        world_size,
        local_rank,
        local_world_size,
        launch.master_addr,
        launch.master_port,
        actual_backend,
    )


def _rendezvous_store(
    launch: LaunchEnv, addr: str, port: int, timeout: timedelta, env: Mapping[str, str]
) -> dist.Store:
    # torchrun's agent already serves a store at its own MASTER_ADDR:MASTER_PORT; rank 0 must
    # then connect to it like every other rank instead of trying to bind the port.
    agent_serves = (
        env.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        and env.get("MASTER_ADDR") == addr
        and env.get("MASTER_PORT") == str(port)
    )
    try:
        store = dist.TCPStore(
            addr,
            port,
            launch.world_size,
            is_master=launch.rank == 0 and not agent_serves,
            timeout=timeout,
            multi_tenant=True,
        )
    except (RuntimeError, OSError) as error:
        raise CommError(
            f"rank {launch.rank} of {launch.world_size} could not set up the rendezvous store "
            f"at {addr}:{port} ({error}); check MASTER_ADDR/MASTER_PORT, that the port is free "
            f"on rank 0's host, and that all ranks were started"
        ) from error
    # Keep our keys apart from the agent's in a shared store, as env:// rendezvous does.
    return dist.PrefixStore("default_pg", store)


def init_distributed(
    backend: str | None = None,
    timeout: timedelta | None = None,
    *,
    env: Mapping[str, str] | None = None,
    dist_backend: str | None = None,
) -> DistInfo:
    """Initialise the default process group from the launcher's environment.

    Reads torchrun/``ds-launch``, Open MPI or SLURM variables (see
    `deepshard.comm._launch_env` for the order and defaults); with none set, the process
    is a world of one on ``127.0.0.1`` and a free port. Binds this rank's device with
    ``get_accelerator().bind_local_rank(local_rank)`` first. If the default group already
    exists, returns its description without re-initialising, after checking that the
    environment and ``backend`` agree with it.

    Args:
        backend: ``"gloo"``, ``"nccl"``, ...; defaults to the accelerator's
            ``communication_backend``.
        timeout: Timeout of the default group (and, through `build_mesh`, of the mesh's
            groups). Defaults to ``DEEPSHARD_TIMEOUT`` minutes, else 10 minutes.
        env: The variables to read; defaults to ``os.environ``.
        dist_backend: DeepSpeed's keyword for ``backend`` (``deepspeed.init_distributed(
            dist_backend="nccl")``); giving both with different values is an error.

    Returns:
        This process's `DistInfo`.

    Raises:
        ConfigError: A launcher variable or ``DEEPSHARD_TIMEOUT`` is missing or invalid (named),
            or ``backend`` and ``dist_backend`` disagree.
        CommError: The rendezvous or the backend failed (e.g. nccl without a GPU), a world of one
            names a ``MASTER_ADDR`` that is not this host, or an existing group contradicts
            the environment.
    """
    if dist_backend is not None:
        if backend is not None and backend != dist_backend:
            raise ConfigError(
                f"init_distributed: backend={backend!r} and dist_backend={dist_backend!r} (its "
                "DeepSpeed name) disagree; pass one"
            )
        backend = dist_backend
    environ: Mapping[str, str] = os.environ if env is None else env
    launch = read_launch_env(environ)
    group_timeout = resolve_timeout(timeout, environ)
    if dist.is_initialized():
        return _already_initialised(launch, backend)
    from deepshard.accelerators import get_accelerator

    accelerator = get_accelerator()
    backend = backend or accelerator.communication_backend
    device = accelerator.bind_local_rank(launch.local_rank)
    addr, port = rendezvous_address(launch)
    store = _rendezvous_store(launch, addr, port, group_timeout, environ)
    # A bound accelerator device lets NCCL/XCCL create the communicator eagerly, which the mesh
    # then splits per axis instead of creating each group from scratch.
    device_id = device if device.type != "cpu" and backend != "gloo" else None
    try:
        dist.init_process_group(
            backend,
            store=store,
            rank=launch.rank,
            world_size=launch.world_size,
            timeout=group_timeout,
            device_id=device_id,
        )
    except (RuntimeError, ValueError) as error:
        raise CommError(
            f"rank {launch.rank} of {launch.world_size} could not create the default process "
            f"group with backend {backend!r} on device {device} ({error}); pass a backend this "
            f"machine supports (e.g. backend='gloo' on CPU, 'nccl' only with NVIDIA GPUs) or "
            f"check that the device and backend library are available"
        ) from error
    return DistInfo(
        launch.rank,
        launch.world_size,
        launch.local_rank,
        launch.local_world_size,
        addr,
        port,
        str(dist.get_backend()),
    )
