"""The world layout: which node runs which global ranks on which slots.

Ranks are numbered node by node in host order, slot by slot within a node (DeepSpeed's and
torchrun's order), so rank ``r`` of node ``k`` is ``first_rank(k) + local_rank``. The layout
travels to remote nodes as one URL-safe base64 JSON argument (``--world``), which needs no shell
quoting and keeps every node's view identical.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import json
from collections.abc import Mapping, Sequence

from deepshard.interface.errors import LaunchError

__all__ = ["NodeSlots", "WorldLayout", "rank_environment"]


@dataclasses.dataclass(frozen=True)
class NodeSlots:
    """One node of the job.

    Attributes:
        host: The host name as written in the hostfile (``localhost`` without one).
        slots: The slot indices its ranks use, one rank per slot, in local-rank order.
    """

    host: str
    slots: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class WorldLayout:
    """Every node of the job in rank order.

    Attributes:
        nodes: The nodes, node rank = position.
    """

    nodes: tuple[NodeSlots, ...]

    def __post_init__(self) -> None:
        if not self.nodes or any(not node.slots for node in self.nodes):
            raise LaunchError("a launch needs at least one node with at least one slot")
        hosts = [node.host for node in self.nodes]
        if len(set(hosts)) != len(hosts):
            raise LaunchError(f"the world layout names a host twice: {hosts}")

    @classmethod
    def from_resources(cls, resources: Mapping[str, Sequence[int]]) -> WorldLayout:
        """Build the layout from ``{host: slots}`` (the output of `resolve_resources`)."""
        return cls(tuple(NodeSlots(host, tuple(slots)) for host, slots in resources.items()))

    @property
    def world_size(self) -> int:
        """Total number of ranks."""
        return sum(len(node.slots) for node in self.nodes)

    @property
    def num_nodes(self) -> int:
        """Number of nodes."""
        return len(self.nodes)

    def first_rank(self, node_rank: int) -> int:
        """Global rank of local rank 0 on node ``node_rank``."""
        return sum(len(node.slots) for node in self.nodes[:node_rank])

    def node_rank_of(self, host: str) -> int:
        """The node rank of ``host``.

        Raises:
            LaunchError: ``host`` is not part of the layout.
        """
        for index, node in enumerate(self.nodes):
            if node.host == host:
                return index
        hosts = ", ".join(node.host for node in self.nodes)
        raise LaunchError(f"host {host!r} is not one of the job's nodes ({hosts})")

    def encode(self) -> str:
        """URL-safe base64 of the JSON ``[[host, [slots...]], ...]`` (shell-safe)."""
        text = json.dumps([[node.host, list(node.slots)] for node in self.nodes])
        return base64.urlsafe_b64encode(text.encode()).decode("ascii")

    @classmethod
    def decode(cls, text: str) -> WorldLayout:
        """Inverse of `encode`.

        Raises:
            LaunchError: ``text`` is not an encoded layout.
        """
        try:
            raw = json.loads(base64.urlsafe_b64decode(text.encode("ascii")))
            nodes = tuple(NodeSlots(str(host), tuple(int(s) for s in slots)) for host, slots in raw)
        except (ValueError, TypeError, binascii.Error) as error:
            raise LaunchError(
                f"--world {text!r} is not an encoded world layout ({error})"
            ) from error
        return cls(nodes)


def rank_environment(
    layout: WorldLayout,
    node_rank: int,
    local_rank: int,
    master_addr: str,
    master_port: int,
) -> dict[str, str]:
    """The variables one rank needs to find its place (torchrun's names plus DeepSpeed's).

    Args:
        layout: The job's layout.
        node_rank: The rank's node.
        local_rank: Its rank on that node.
        master_addr: Host of rank 0's rendezvous store.
        master_port: Its port.

    Returns:
        ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, DeepSpeed's
        ``LOCAL_SIZE``/``CROSS_RANK``/``CROSS_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT``.
    """
    local_size = len(layout.nodes[node_rank].slots)
    return {
        "RANK": str(layout.first_rank(node_rank) + local_rank),
        "LOCAL_RANK": str(local_rank),
        "WORLD_SIZE": str(layout.world_size),
        "LOCAL_WORLD_SIZE": str(local_size),
        "LOCAL_SIZE": str(local_size),
        "CROSS_RANK": str(node_rank),
        "CROSS_SIZE": str(layout.num_nodes),
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(master_port),
    }
