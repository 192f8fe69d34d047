"""``--elastic_training``: nodes may join and leave; PyTorch's elastic agent re-forms the job.

With ``--elastic_training --min_elastic_nodes N --max_elastic_nodes M`` every node runs one
torchrun agent (the ``torchrun`` backend, chosen by the flag) in dynamic mode: the agents meet
in a c10d rendezvous at ``--master_addr:--master_port`` (hosted by the first agent there) under
one run id, and the job starts with every node that has joined once at least ``N`` have (at
most ``M``). When a node fails or leaves, the survivors' workers stop and their agents
rendezvous again and restart the workers on the new node count, up to ``--max_restarts``
times (the agent's restarts, not ``ds-launch``'s: ``ds-launch`` does not restart an elastic
job itself). A node started later joins at the next re-rendezvous. Each launch of a node
(one ``ds-launch`` per node, or one per node through ssh) must name the same address and port,
so the port is not probed and moved as for a fixed job.

The training script reads its new world from the environment at each start
(``WORLD_SIZE``, ``RANK``; ``TORCHELASTIC_RESTART_COUNT`` counts the re-formations), and under
`deepshard.engine` an ``elasticity`` config keeps the global batch fixed across them.
"""

from __future__ import annotations

import dataclasses
import re

from deepshard.interface.errors import LaunchError

__all__ = ["ElasticNodes", "elastic_torchrun_args"]

_RUN_ID = re.compile(r"[^A-Za-z0-9_-]")


@dataclasses.dataclass(frozen=True)
class ElasticNodes:
    """The node range of an elastic job.

    Attributes:
        min_nodes: ``--min_elastic_nodes``: the job starts (and goes on) with this many.
        max_nodes: ``--max_elastic_nodes``: at most this many take part (``None``: the nodes
            of the launch's layout, as DeepSpeed defaults it).
    """

    min_nodes: int = 1
    max_nodes: int | None = None

    def __post_init__(self) -> None:
        if self.min_nodes < 1:
            raise LaunchError(f"--min_elastic_nodes must be at least 1, got {self.min_nodes}")
        if self.max_nodes is not None and self.max_nodes < self.min_nodes:
            raise LaunchError(
                f"--max_elastic_nodes {self.max_nodes} is below --min_elastic_nodes "
                f"{self.min_nodes}; raise it or lower the minimum"
            )


def elastic_torchrun_args(
    elastic: ElasticNodes, *, addr: str, port: int, max_restarts: int, num_nodes: int
) -> str:
    """The torchrun arguments of an elastic job (they follow, and so override, the fixed ones).

    The run id is derived from the rendezvous address so that every node's launch, started
    separately, names the same one.

    Raises:
        LaunchError: The layout has more nodes than ``--max_elastic_nodes``.
    """
    most = num_nodes if elastic.max_nodes is None else elastic.max_nodes
    if num_nodes > most:
        raise LaunchError(
            f"the launch has {num_nodes} nodes but --max_elastic_nodes is {most}; raise it"
        )
    run_id = _RUN_ID.sub("-", f"deepshard-{addr}-{port}")
    words = [
        f"--nnodes={min(elastic.min_nodes, most)}:{most}",
        "--rdzv_backend=c10d",
        f"--rdzv_endpoint={addr}:{port}",
        f"--rdzv_id={run_id}",
        f"--max_restarts={max_restarts}",
    ]
    return " ".join(words)
