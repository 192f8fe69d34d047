"""Process groups, the named device mesh, collectives with async handles, a comms logger and a
comms watchdog.

``init_distributed()`` joins the world from the launcher's environment; ``build_mesh(topology)``
creates the mesh whose named axes (``pp, dp, ep, sp, tp``) every other package receives, and
``ParallelDims.build(topology)`` adds every group derived from it (dense and expert
data-parallel, batch, world).
"""

from __future__ import annotations

from deepshard.comm._groups import Group, resolve_group
from deepshard.comm._handles import CommHandle
from deepshard.comm._init import DistInfo, init_distributed
from deepshard.comm.a2a import all_to_all_single_autograd
from deepshard.comm.collectives import (
    all_gather_into_tensor,
    all_reduce,
    all_to_all_single,
    barrier,
    broadcast,
    reduce_scatter_tensor,
)
from deepshard.comm.lockstep import mark_collective_forward
from deepshard.comm.logger import CommRecord, CommsLogger, CommTiming
from deepshard.comm.mesh import build_mesh
from deepshard.comm.parallel_dims import ParallelDims
from deepshard.comm.region import copy_to_group, reduce_from_group
from deepshard.comm.watchdog import CommWatchdog, WatchedCall

__all__ = [
    "CommHandle",
    "CommRecord",
    "CommTiming",
    "CommWatchdog",
    "CommsLogger",
    "DistInfo",
    "Group",
    "ParallelDims",
    "WatchedCall",
    "all_gather_into_tensor",
    "all_reduce",
    "all_to_all_single",
    "all_to_all_single_autograd",
    "barrier",
    "broadcast",
    "build_mesh",
    "copy_to_group",
    "init_distributed",
    "mark_collective_forward",
    "reduce_from_group",
    "reduce_scatter_tensor",
    "resolve_group",
]
