"""How the engine attaches ZeRO: which group it partitions over, and when a pass is a boundary.

The engine describes the model's parameters with the caller's placement registry
(``initialize(placements=)``, checked by `deepshard.engine._placements_arg`), else the default
one (every parameter whole on every rank, reduced over ``dp × ep × sp``,
`Topology.dense_dp_axes`), and
hands ZeRO the matching group from `deepshard.comm.ParallelDims` (``dims.dense_dp``); ZeRO
checks the two agree and derives its shard maps from the placements.

ZeRO reduces gradients *during* the backward pass that ends an accumulation cycle, from its
parameter hooks, so it must know before the pass starts whether it is a boundary, also when the
user calls ``loss.backward()`` directly: the engine declares it after every micro-step with
``ZeroOptimizer.set_boundary`` from its counter.

Muon is not element-wise: its ``use_muon`` matrices need their whole reduced gradient. For a
`deepshard.optimizers.Muon` the engine hands ZeRO a full-gradient transform (``muon_update``
with the momentum as ZeRO's persistent buffer) for exactly those parameters; ZeRO all-reduces
their buckets whole and gives Muon the finished update (see `deepshard.zero.FullGradTransform`).

Every stage shards the (cast) model first (`deepshard.zero.shard` on ``dims.dense_dp`` with the
policy of the ``zero_optimization`` section, `deepshard.zero.zero_policy`; at stages 0-2 its
units stay resident and only plan the gradient buckets), then builds the optimizer side on it;
the module stays the user's object. A model built under `deepshard.zero.Init` is sharded
already: its `ShardedModule` (checked by `deepshard.engine._init_built`) is used as it is.
Muon at stage 3 takes the same transform (its matrices' gradients are gathered from the
partitions at the step, `deepshard.zero._stage3_muon`); the optimizer was built on the whole
parameters before sharding, so its halves are split by their real shapes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh

from deepshard.comm import CommsLogger, ParallelDims
from deepshard.engine._placements_arg import engine_placements
from deepshard.interface import DeepShardConfig, PlacementRegistry
from deepshard.interface.errors import ConfigError
from deepshard.optimizers import Muon, muon_update
from deepshard.zero import (
    ResidentModule,
    ShardedModule,
    ZeroOptimizer,
    build_zero_optimizer,
    optimizer_side_problems,
    shard,
    sharded_module_of,
    zero_policy,
)

__all__ = ["parallel_dims", "wrap_with_zero"]


def parallel_dims(mesh: DeviceMesh | ParallelDims) -> ParallelDims:
    """The `ParallelDims` of what the caller passed to ``initialize`` as its mesh.

    Raises:
        TopologyError: A mesh without DeepShard's five axes in row-major order.
    """
    return mesh if isinstance(mesh, ParallelDims) else ParallelDims.from_mesh(mesh)


def wrap_with_zero(
    optimizer: torch.optim.Optimizer,
    config: DeepShardConfig,
    *,
    dims: ParallelDims,
    module: torch.nn.Module,
    comms_logger: CommsLogger | None,
    placements: PlacementRegistry | None = None,
) -> ZeroOptimizer:
    """Wraps ``optimizer`` with the ZeRO stage (0-3) the config selects.

    Args:
        optimizer: The inner optimizer on the module's (already cast) parameters.
        config: The whole config (ZeRO reads its section and the gradient settings).
        dims: The training mesh and its groups (ZeRO gets ``dims.dense_dp``).
        module: The model (already cast): its parameter names and shapes make the placements.
        comms_logger: Records every collective ZeRO issues.
        placements: The model's placement registry (``initialize(placements=)``); ``None``:
            every parameter whole on every rank (`engine_placements`).

    Returns:
        The wrapper.

    Raises:
        ConfigError: As `deepshard.zero.build_zero_optimizer` does (offload,
            ``compute_grad_norm: false`` with clipping, an untested optimizer...).
    """
    given = placements
    placements = engine_placements(placements, module, dims.topology)
    muon = isinstance(optimizer, Muon)
    problems = optimizer_side_problems(optimizer, config, transformed=muon)
    if problems:  # before shard() re-points the model's parameters
        raise ConfigError.from_problems(problems)
    # a model built under deepshard.zero.Init is sharded already (stage 3, checked)
    sharded: ShardedModule | ResidentModule | None = sharded_module_of(module)
    if sharded is not None and given is not None:
        raise ConfigError(
            "initialize(placements=): the model was built under deepshard.zero.Init, which "
            "sharded it with its own placements already; drop the argument"
        )
    if sharded is None:
        sharded = shard(
            module,
            parallel_dims=dims,
            policy=zero_policy(config),
            placements=placements,
            comms_logger=comms_logger,
        )
    return build_zero_optimizer(
        optimizer,
        config,
        group=dims.dense_dp,
        full_grad_transform=_muon_transform if muon else None,
        transformed_params=_muon_params(optimizer) if muon else (),
        sharded_module=sharded,
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
