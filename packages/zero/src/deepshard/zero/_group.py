"""The data-parallel group argument: a process group or a 1-D device mesh standing for one."""

from __future__ import annotations

from typing import TypeAlias

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from deepshard.interface.errors import TopologyError

__all__ = ["Group", "resolve_group"]

Group: TypeAlias = dist.ProcessGroup | DeviceMesh
"""What ZeRO accepts as its data-parallel group, e.g. ``mesh["dp"]``."""


def resolve_group(group: Group) -> dist.ProcessGroup:
    """The process group behind ``group``.

    Raises:
        TopologyError: ``group`` is a mesh with more than one axis, or not a group at all.
    """
    if isinstance(group, DeviceMesh):
        if group.ndim != 1:
            raise TopologyError(
                f"ZeRO needs its data-parallel group as one mesh axis, got a mesh with axes "
                f"{group.mesh_dim_names}; pass mesh['dp'], or the flattened data-parallel group "
                "deepshard.comm.ParallelDims.build(topology).dense_dp"
            )
        return group.get_group()
    if isinstance(group, dist.ProcessGroup):
        return group
    raise TopologyError(
        f"group must be a torch.distributed ProcessGroup or a 1-D DeviceMesh, got "
        f"{type(group).__name__}"
    )
