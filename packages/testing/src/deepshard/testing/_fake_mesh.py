"""A device mesh for one rank of a larger world, in the current process, without communication.

PyTorch's fake process group answers every collective instantly with garbage data but knows its
rank and world size, and ``new_group`` works on it. That is all a mesh needs to work out a rank's
coordinates and the members of each axis group, so rank arithmetic (which shard does rank 3 of
8 own?) can be tested without starting any processes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from deepshard.interface import Topology

__all__ = ["fake_mesh"]


@contextlib.contextmanager
def fake_mesh(topology: Topology, rank: int) -> Iterator[DeviceMesh]:
    """Play ``rank`` of ``topology`` in this process, on a fake process group.

    The default process group exists only inside the ``with`` block. Collectives return
    without moving data: use this for rank arithmetic, never to check values.

    Args:
        topology: The parallel layout; the fake world has ``topology.world_size`` ranks.
        rank: The global rank to play.

    Yields:
        ``build_mesh(topology)`` as seen by ``rank`` (CPU device type).

    Raises:
        TopologyError: ``rank`` is outside ``[0, topology.world_size)``.
        CommError: A default process group already exists in this process.
    """
    import torch.distributed as dist

    # Importing this module registers the "fake" backend; torch has no public spelling of it.
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from deepshard.comm import build_mesh
    from deepshard.interface.errors import CommError, TopologyError

    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < topology.world_size:
        raise TopologyError(
            f"fake_mesh: rank {rank!r} is outside the world of {topology.world_size} ranks "
            f"described by {topology!r}"
        )
    if dist.is_initialized():
        raise CommError(
            "fake_mesh: a default process group is already initialised in this process; "
            "destroy it first (torch.distributed.destroy_process_group())"
        )
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=topology.world_size)
    try:
        yield build_mesh(topology, device_type="cpu")
    finally:
        dist.destroy_process_group()
