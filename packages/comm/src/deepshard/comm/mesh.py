"""Build the named device mesh of a `deepshard.interface.Topology`.

The mesh always has all five axes of ``Topology.AXES`` (``pp, dp, ep, sp, tp``, outermost first),
size-1 axes included, so that code can ask for ``mesh["tp"]`` whatever the layout. PyTorch's
``init_device_mesh`` creates the per-axis process groups; DeepShard only checks the world size
and gives every new group a timeout through the backend's group options (``new_group`` would
otherwise fall back to PyTorch's own default instead of the timeout the default process group
was created with). ``init_device_mesh`` takes no other way to pass a timeout, so when the
options cannot carry it (a backend without such options, e.g. mpi, or a default group whose
timeout cannot be read) `build_mesh` raises `CommError` rather than silently creating groups
with PyTorch's default. The in-process ``fake`` test backend never waits and is exempt.
"""

from __future__ import annotations

from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from deepshard.interface.errors import CommError, TopologyError

if TYPE_CHECKING:
    from deepshard.interface import Topology

__all__ = ["build_mesh"]


def _backend_for(device_type: str) -> str:
    """The default group's backend for ``device_type`` (``"cpu:gloo,cuda:nccl"`` is split)."""
    name = str(dist.get_backend())
    if ":" not in name:
        return name
    pairs = dict(part.split(":", 1) for part in name.split(","))
    return pairs.get(device_type, "")


def _default_device_type() -> str:
    if str(dist.get_backend()) == "gloo":
        return "cpu"
    from deepshard.accelerators import get_accelerator

    return get_accelerator().name


def _default_group_timeout(device_type: str) -> timedelta | None:
    group = dist.distributed_c10d._get_default_group()
    try:
        timeout = group._get_backend(torch.device(device_type)).options._timeout
    except (RuntimeError, AttributeError):
        return None
    return timeout if isinstance(timeout, timedelta) else None


# Backends whose groups never wait on peers, so a timeout means nothing (testing only).
_NO_WAIT_BACKENDS = frozenset({"fake"})


def _group_options(backend: str, timeout: timedelta) -> Any | None:
    """Backend options carrying ``timeout``, or ``None`` for a backend we cannot configure."""
    if backend == "gloo":
        options: Any = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    elif backend in ("nccl", "xccl") and hasattr(dist, f"ProcessGroup{backend.upper()}"):
        options = getattr(dist, f"ProcessGroup{backend.upper()}").Options()
    else:
        return None
    options._timeout = timeout
    return options


def _no_timeout_error(backend: str, reason: str) -> CommError:
    return CommError(
        f"build_mesh cannot give the {backend!r} axis groups a timeout: {reason}, and PyTorch "
        "would silently use its own default instead. Use a backend whose groups take a timeout "
        "(gloo, nccl, xccl), or create the mesh yourself with "
        "torch.distributed.device_mesh.init_device_mesh if PyTorch's default is acceptable."
    )


def group_timeouts(
    device_type: str, timeout: timedelta | None
) -> tuple[timedelta, timedelta | None] | None:
    """The timeout new groups must get, and the default group's; None for a no-wait backend.

    Shared by `build_mesh` and `deepshard.comm.ParallelDims` so that every group DeepShard
    creates follows one rule (see the module docstring).

    Raises:
        CommError: The timeout cannot be read or the backend's groups cannot take one.
    """
    backend = _backend_for(device_type)
    if backend in _NO_WAIT_BACKENDS:
        return None
    default_timeout = _default_group_timeout(device_type)
    wanted = timeout if timeout is not None else default_timeout
    if wanted is None:
        raise _no_timeout_error(backend, "the default group's timeout cannot be read")
    if _group_options(backend, wanted) is None:
        raise _no_timeout_error(backend, "its groups take no timeout options")
    return wanted, default_timeout


def _timeout_overrides(
    topology: Topology, device_type: str, timeout: timedelta | None
) -> dict[int | str, Any] | None:
    timeouts = group_timeouts(device_type, timeout)
    if timeouts is None:
        return None
    wanted, default_timeout = timeouts
    options = _group_options(_backend_for(device_type), wanted)
    world_size = topology.world_size
    # An axis spanning the whole world reuses the default group, which already has the
    # timeout, unless the caller asked for a different one.
    return {
        axis: options
        for axis, size in zip(topology.axis_names, topology.shape, strict=True)
        if size != world_size or wanted != default_timeout
    } or None


def build_mesh(
    topology: Topology, *, device_type: str | None = None, timeout: timedelta | None = None
) -> DeviceMesh:
    """Create the device mesh for ``topology`` over the initialised default process group.

    Every rank must call it, with the same topology (it creates process groups).

    Args:
        topology: The parallel layout; its world size must equal the default group's.
        device_type: ``"cpu"``, ``"cuda"``, ... Defaults to ``"cpu"`` when the default group is
            gloo-only, else to the current accelerator's name.
        timeout: Timeout of the axis process groups; defaults to the default group's timeout.

    Returns:
        A ``DeviceMesh`` with ``mesh_dim_names == Topology.AXES`` and shape ``topology.shape``;
        ``mesh.get_group("dp")`` is this rank's data-parallel group.

    Raises:
        CommError: No default process group is initialised, or the axis groups' backend
            cannot be given the timeout (see the module docstring).
        TopologyError: ``topology.world_size`` differs from the process group's world size.
    """
    if not dist.is_initialized():
        raise CommError(
            "build_mesh needs an initialised default process group: call "
            "deepshard.comm.init_distributed() (or torch.distributed.init_process_group) first"
        )
    world_size = dist.get_world_size()
    if topology.world_size != world_size:
        raise TopologyError(
            f"the topology {dict(zip(topology.axis_names, topology.shape, strict=True))} needs "
            f"{topology.world_size} ranks but the process group has {world_size}; "
            f"choose axis sizes whose product is {world_size} (e.g. Topology.from_world)"
        )
    device_type = device_type or _default_device_type()
    return init_device_mesh(
        device_type,
        tuple(topology.shape),
        mesh_dim_names=tuple(topology.axis_names),
        backend_override=_timeout_overrides(topology, device_type, timeout),
    )
