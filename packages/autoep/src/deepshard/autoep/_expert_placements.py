"""Placements and shard maps of a model after `parallelize_experts` (see `_replace`).

Every parameter gets a placement: the expert stacks ``Shard(0)`` on ``ep`` with their global
shape, reduced over ``dp`` (under expert TP also split over ``tp``: ``gate_up`` by each half's
rows, ``Shard(1, (I, I))``; ``down`` by columns, ``Shard(2)``); all others replicated and reduced
over ``dp × ep × sp``. Each expert stack also gets its `ShardMap` over ``ep`` (``ep × tp``).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import torch
from torch import nn

from deepshard.autoep._report import ParamSwap
from deepshard.comm import ParallelDims
from deepshard.interface import (
    ParamPlacement,
    PartitionedParams,
    PlacementRegistry,
    Shard,
    ShardMap,
    ShardPiece,
    Topology,
)

__all__ = ["expert_placements"]


class _Shaped:
    """A parameter's full shape and dtype, as `PlacementRegistry.replicated` reads them."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        self.shape, self.dtype = shape, dtype


def _full_shapes(
    model: nn.Module, partitioned: PartitionedParams | None
) -> list[tuple[str, _Shaped]]:
    """``model.named_parameters()`` with each parameter's full shape (partitioned or not)."""
    shape_of = partitioned.full_shape if partitioned is not None else lambda p: tuple(p.shape)
    return [(n, _Shaped(tuple(shape_of(p)), p.dtype)) for n, p in model.named_parameters()]


def _expert_placement(
    swap: ParamSwap, local: tuple[int, ...], topology: Topology, expert_tp: bool
) -> ParamPlacement:
    """An expert stack's placement: experts ``Shard(0)`` on ``ep``; under expert TP also its
    ``tp`` split (``gate_up``: each half's rows, ``Shard(1, (I, I))``; ``down``: its columns,
    ``Shard(2)``). Reduced over ``dp`` either way."""
    tp = topology.tp if expert_tp else 1
    gate_up = swap.name.endswith("gate_up_proj")
    split_dim = 1 if gate_up else 2
    global_shape = [local[0] * topology.ep, *local[1:]]
    global_shape[split_dim] *= tp
    dtype = str(swap.new.dtype).removeprefix("torch.")
    placement = ParamPlacement.replicated(
        tuple(global_shape), dtype, reduce_over=Topology.expert_dp_axes
    ).with_axis("ep", Shard(0))
    if tp == 1:
        return placement
    half = global_shape[1] // 2
    return placement.with_axis("tp", Shard(1, (half, half)) if gate_up else Shard(2))


def _expert_map(placement: ParamPlacement, topology: Topology, axes: tuple[str, ...]) -> ShardMap:
    """Every holder's boxes of ``placement`` over ``axes`` (rank = index in that grid, row
    major), each rank's boxes back to back from local offset 0."""
    pieces = []
    sizes = [getattr(topology, a) for a in axes]
    for rank, at in enumerate(itertools.product(*(range(n) for n in sizes))):
        coords = {a: 0 for a in topology.axis_names} | dict(zip(axes, at, strict=True))
        local = 0
        for offset, box in placement.local_boxes(topology, coords):
            pieces.append(ShardPiece(rank, offset, box, local_offset=local))
            local += math.prod(box)
    return ShardMap(placement.global_shape, placement.dtype, tuple(pieces), axes=axes)


def expert_placements(
    model: nn.Module,
    dims: ParallelDims,
    swaps: Sequence[ParamSwap],
    partitioned: PartitionedParams | None,
    expert_tp: bool,
) -> tuple[PlacementRegistry, dict[str, ShardMap]]:
    topology = dims.topology
    shapes = _full_shapes(model, partitioned)
    registry = PlacementRegistry.replicated(shapes, topology)
    local = dict(shapes)
    axes = ("ep", "tp") if expert_tp else ("ep",)
    maps: dict[str, ShardMap] = {}
    for swap in swaps:
        placement = _expert_placement(swap, local[swap.name].shape, topology, expert_tp)
        registry.set(swap.name, placement)
        maps[swap.name] = _expert_map(placement, topology, axes)
    return registry, maps
