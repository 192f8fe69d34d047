"""How the engine attaches ZeRO: which group it partitions over, and when a pass is a boundary.

Dense parameters are replicated over the mesh axes ``dp × ep × sp`` (`Topology.dense_dp_axes`),
so that is the group ZeRO reduces gradients and partitions state over: ``mesh["dp"]`` when it
is the only one of them larger than 1, else those axes flattened into one.

ZeRO reduces gradients *during* the backward pass that ends an accumulation cycle, from its
parameter hooks, so it must know before the pass starts whether it is a boundary, also when the
user calls ``loss.backward()`` directly: the engine declares it after every micro-step with
``ZeroOptimizer.set_boundary`` from its counter.

Muon is not element-wise: its ``use_muon`` matrices need their whole reduced gradient. For a
`deepshard.optimizers.Muon` the engine hands ZeRO a full-gradient transform (``muon_update``
with the momentum as ZeRO's persistent buffer) for exactly those parameters; ZeRO all-reduces
their buckets whole and gives Muon the finished update (see `deepshard.zero.FullGradTransform`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh

from deepshard.comm import CommsLogger
from deepshard.interface import DeepShardConfig, Topology, TopologyError
from deepshard.optimizers import Muon, muon_update
from deepshard.zero import ZeroOptimizer, build_zero_optimizer

__all__ = ["MeshRanks", "dense_dp_group", "wrap_with_zero"]


def _axis_size(mesh: DeviceMesh, axis: str) -> int:
    names = mesh.mesh_dim_names or ()
    return mesh[axis].size() if axis in names else 1


def _check_named(mesh: DeviceMesh) -> None:
    names = mesh.mesh_dim_names or ()
    if "dp" not in names:
        raise TopologyError(
            f"the mesh passed to initialize has axes {names or '(unnamed)'}; it needs a 'dp' "
            "axis (build it with deepshard.comm.build_mesh(topology))"
        )


def dense_dp_group(mesh: DeviceMesh) -> tuple[DeviceMesh, tuple[str, ...]]:
    """The one-axis mesh dense gradients are reduced over, and the mesh axes it spans.

    Args:
        mesh: The training mesh (axes named as in `Topology.AXES`; missing ones count as 1).

    Returns:
        ``(group, axes)``: ``mesh["dp"]`` and ``("dp",)`` unless ``ep`` or ``sp`` is larger
        than 1, then the flattened axes.

    Raises:
        TopologyError: The mesh has no ``dp`` axis.
    """
    _check_named(mesh)
    axes = tuple(a for a in Topology.dense_dp_axes if a == "dp" or _axis_size(mesh, a) > 1)
    if axes == ("dp",):
        return mesh["dp"], axes
    return mesh[axes]._flatten(), axes


class MeshRanks:
    """Where this rank sits for the data: its index among the ranks reading different samples.

    Args:
        mesh: The training mesh.

    Raises:
        TopologyError: The mesh has no ``dp`` axis.
    """

    def __init__(self, mesh: DeviceMesh) -> None:
        _check_named(mesh)
        ep = _axis_size(mesh, "ep")
        ep_rank = mesh["ep"].get_local_rank() if ep > 1 else 0
        self.global_rank = mesh.get_rank()
        """The rank in the whole world."""
        self.batch_world_size = mesh["dp"].size() * ep
        """Ranks that each read their own micro-batch (dp × ep)."""
        self.batch_rank = mesh["dp"].get_local_rank() * ep + ep_rank
        """This rank's index among them."""


def wrap_with_zero(
    optimizer: torch.optim.Optimizer,
    config: DeepShardConfig,
    *,
    mesh: DeviceMesh,
    module: torch.nn.Module,
    comms_logger: CommsLogger | None,
) -> ZeroOptimizer:
    """Wraps ``optimizer`` with the ZeRO stage (0, 1 or 2) the config selects.

    Args:
        optimizer: The inner optimizer on the module's (already cast) parameters.
        config: The whole config (ZeRO reads its section and the gradient settings).
        mesh: The training mesh.
        module: The model, for parameter names in the shard maps.
        comms_logger: Records every collective ZeRO issues.

    Returns:
        The wrapper.

    Raises:
        ConfigError: As `deepshard.zero.build_zero_optimizer` does (stage 3, offload,
            ``compute_grad_norm: false`` with clipping, an untested optimizer...).
    """
    group, axes = dense_dp_group(mesh)
    muon = isinstance(optimizer, Muon)
    return build_zero_optimizer(
        optimizer,
        config,
        group=group,
        comms_logger=comms_logger,
        named_parameters=module.named_parameters(),
        axes=axes,
        full_grad_transform=_muon_transform if muon else None,
        transformed_params=_muon_params(optimizer) if muon else (),
    )


def _muon_transform(
    grad: torch.Tensor, momentum: torch.Tensor, group: Mapping[str, Any]
) -> torch.Tensor:
    """Muon's update of one whole reduced gradient, with its momentum buffer and group settings."""
    return muon_update(
        grad, momentum, beta=float(group["momentum"]), ns_method=str(group["ns_method"])
    )


def _muon_params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The parameters of Muon's ``use_muon`` groups (read before ZeRO re-points the groups)."""
    return [p for g in optimizer.param_groups if g.get("use_muon") for p in g["params"]]
