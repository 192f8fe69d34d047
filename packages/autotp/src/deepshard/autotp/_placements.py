"""What a TP plan means for each parameter: its `ParamPlacement` and its `ShardMap`.

A sharded parameter's placement says ``Shard(dim)`` on the ``tp`` axis (its global shape is
the unsharded one; its gradient is reduced over the dense data-parallel axes, as for any dense
parameter); a fused weight whose sub-parameters each split evenly (a ``gate_up_proj``, a QKV
whose KV heads divide) says ``Shard(dim, parts)``. `Shard` means *equal* slices, which is what
ZeRO and the optimizers compute local shapes from; a split the plan makes uneven (KV-head
groups that do not divide, a vocabulary that is not a multiple of the TP size) has no such
placement, and is described by its shard map alone (ZeRO cannot lay it out, so the engine
refuses it, naming the parameter and its rows per rank).

The shard map is exact in every case: one piece per (rank, sub-parameter), the rank's pieces
stored back to back in its local tensor, so the checkpoint package can reshard a weight saved
at one TP size into another. A fused weight split along dim 1 would interleave its parts in
every row of the local storage, which a box and flat range cannot say; AutoTP splits fused
weights along dim 0 only (the output features of a column layer).
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
from torch import nn

from deepshard.autotp._plan_types import LayerPlan, Style, TPPlan
from deepshard.interface.errors import ConfigError
from deepshard.interface.placement import ParamPlacement, PlacementRegistry, Shard
from deepshard.interface.shard_map import ShardMap, ShardPiece
from deepshard.interface.topology import Topology

__all__ = ["build_placements", "even_split", "sharded_parameters", "tp_shard_map"]


def sharded_parameters(layer: LayerPlan) -> tuple[tuple[str, int], ...]:
    """The parameters (local name, split dim) a layer's style cuts; the rest stay whole."""
    if layer.style is Style.COLUMN:
        return (("weight", 0), ("bias", 0))
    if layer.style is Style.ROW:
        return (("weight", 1),)
    if layer.style is Style.VOCAB:
        return (("weight", 0),)
    return ()


def tp_shard_map(
    global_shape: tuple[int, ...], dtype: str, layer: LayerPlan, dim: int, tp_size: int
) -> ShardMap:
    """Where each TP rank's shard of one parameter lies in the whole tensor.

    Args:
        global_shape: The unsharded shape.
        dtype: Its dtype as torch names it.
        layer: The module's plan (its ``sizes`` cut ``dim``).
        dim: The split dimension.
        tp_size: Ranks in the TP group.

    Raises:
        ConfigError: A fused (several sub-parameter) split along a dim other than 0.
    """
    if len(layer.sizes) > 1 and math.prod(global_shape[:dim]) != 1:
        raise ConfigError(
            f"{layer.module!r}: a fused weight of {len(layer.sizes)} sub-parameters split along "
            f"dim {dim} of {global_shape} cannot be checkpointed as a shard map; split it "
            "along dim 0 (partition_type 'column') or give its parts as separate modules",
            [("tensor_parallel.partition_config.layer_specs", f"shape of {layer.module!r}")],
        )
    row = math.prod(global_shape[dim + 1 :])
    pieces = []
    for rank in range(tp_size):
        local = 0
        for start, length in layer.offsets(rank):
            if length:
                offset = tuple(start if d == dim else 0 for d in range(len(global_shape)))
                box = tuple(length if d == dim else n for d, n in enumerate(global_shape))
                pieces.append(ShardPiece(rank, offset, box, local_offset=local * row))
            local += length
    return ShardMap(global_shape, dtype, tuple(pieces), axes=("tp",))


def even_split(layer: LayerPlan, dim: int) -> Shard | None:
    """What ``Shard`` says of the split, when it is even: ``Shard(dim)`` for one part cut in
    equal slices, ``Shard(dim, parts)`` for a fused weight whose every part is; else None."""
    if not layer.sizes or any(len(set(per_rank)) != 1 for per_rank in layer.sizes):
        return None
    if len(layer.sizes) == 1:
        return Shard(dim)
    return Shard(dim, tuple(sum(per_rank) for per_rank in layer.sizes))


def _layer_params(model: nn.Module, layer: LayerPlan) -> Iterator[tuple[str, torch.Tensor, int]]:
    module = model.get_submodule(layer.module)
    for local_name, dim in sharded_parameters(layer):
        param = getattr(module, local_name, None)
        if isinstance(param, torch.Tensor):
            yield f"{layer.module}.{local_name}" if layer.module else local_name, param, dim


def build_placements(
    model: nn.Module,
    plan: TPPlan,
    topology: Topology,
    *,
    full_shapes: dict[str, tuple[int, ...]],
    registry: PlacementRegistry | None = None,
) -> tuple[PlacementRegistry, dict[str, ShardMap]]:
    """The placements and shard maps of a model that ``plan`` has been applied to.

    Args:
        model: The parallelised model (its parameters are the local shards).
        plan: The plan that was applied.
        topology: The mesh's axis sizes.
        full_shapes: The unsharded shape of every parameter the plan cuts, by name.
        registry: Where to write the placements; a new one when None.

    Returns:
        The registry (``Shard(dim)`` on ``tp`` for an even split, ``Shard(dim, parts)`` for a
        fused weight whose every part splits evenly, replicated for a parameter the plan leaves
        whole, absent for an uneven split) and a shard map per sharded parameter.
    """
    registry = registry if registry is not None else PlacementRegistry(topology)
    maps: dict[str, ShardMap] = {}
    for layer in plan.layers:
        for name, param, dim in _layer_params(model, layer):
            dtype = str(param.dtype).removeprefix("torch.")
            maps[name] = tp_shard_map(full_shapes[name], dtype, layer, dim, plan.tp_size)
            split = even_split(layer, dim)
            if split is not None:
                whole = ParamPlacement.replicated(full_shapes[name], dtype)
                registry.set(name, whole.with_axis("tp", split))
    whole_params = ((n, p) for n, p in model.named_parameters() if n not in maps)
    for name, placement in PlacementRegistry.replicated(whole_params, topology).items():
        registry.set(name, placement)
    return registry, maps
