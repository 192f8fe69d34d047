"""ZeRO reads parameter placements: shard maps of a tensor-parallel slice locate the global tensor.

Rank 3 (and 6) of 8 is played on a fake process group laid out as dp=2 × ep=2 × tp=2. Each
rank's model holds its tp half of a global weight (rows split over tp, ``Shard(0)``), ZeRO
partitions it over the dense data-parallel group ``dp × ep``; the pieces it reports must carry
the holder's coordinate on every mesh axis and, read through the interface's affine map, pick
out of the *global* tensor exactly the values in this rank's master partition.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from deepshard.comm import ParallelDims
from deepshard.interface import (
    FlatShard,
    ParamPlacement,
    PlacementRegistry,
    Replicate,
    Shard,
    Topology,
)
from deepshard.interface.config import ZeroConfig
from deepshard.interface.errors import ConfigError, TopologyError
from deepshard.testing import fake_mesh
from deepshard.zero import ZeroOptimizer, ZeroPolicy
from deepshard.zero import shard as zero_shard

TOPOLOGY = Topology(dp=2, ep=2, tp=2)
ROWS, COLS = 12, 10  # global weight; each tp rank holds 6 rows


@pytest.fixture(params=[3, 6])
def dims(request: pytest.FixtureRequest) -> Iterator[ParallelDims]:
    with fake_mesh(TOPOLOGY, request.param) as mesh:
        yield ParallelDims.from_mesh(mesh)


def _global() -> dict[str, torch.Tensor]:
    return {
        "0.weight": torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS),
        "0.bias": torch.arange(ROWS, dtype=torch.float32) + 1000.0,
        "1.weight": torch.arange(3 * ROWS, dtype=torch.float32).reshape(3, ROWS) + 2000.0,
    }


def _tp_model(tp_rank: int) -> torch.nn.Module:
    """Column-parallel first layer (this rank's rows), replicated second layer."""
    full = _global()
    model = torch.nn.Sequential(torch.nn.Linear(COLS, ROWS // 2), torch.nn.Linear(ROWS, 3))
    half = slice(tp_rank * ROWS // 2, (tp_rank + 1) * ROWS // 2)
    with torch.no_grad():
        model[0].weight.copy_(full["0.weight"][half])
        model[0].bias.copy_(full["0.bias"][half])
        model[1].weight.copy_(full["1.weight"])
        model[1].bias.zero_()
    return model


def _registry(model: torch.nn.Module) -> PlacementRegistry:
    registry = PlacementRegistry.replicated([], TOPOLOGY)
    for name, param in model.named_parameters():
        shape = _global()[name].shape if name in _global() else param.shape
        placement = ParamPlacement.replicated(tuple(shape), "float32")
        if name.startswith("0."):
            placement = placement.with_axis("tp", Shard(0))
        registry.set(name, placement)
    return registry


def _members(rank: int, axes: tuple[str, ...]) -> list[int]:
    """Independent enumeration of the ranks equal to ``rank`` outside ``axes``."""
    grid = list(itertools.product(*(range(s) for s in TOPOLOGY.shape)))
    fixed = [i for i, a in enumerate(TOPOLOGY.AXES) if a not in axes]
    return [r for r, c in enumerate(grid) if all(c[i] == grid[rank][i] for i in fixed)]


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_pieces_locate_the_global_tensor_and_carry_mesh_coordinates(
    dims: ParallelDims, stage: int
) -> None:
    model = _tp_model(dims.coordinate["tp"])
    zero = _tp_zero(model, dims, _registry(model), stage=stage)
    members = _members(dims.rank, ("dp", "ep", "sp"))
    group_rank = members.index(dims.rank)
    full = _global()
    for shard in zero.shard_maps():
        smap = shard.shard_map
        assert smap.global_shape == tuple(full.get(shard.name, torch.zeros(3)).shape)
        assert smap.axes == ("dp", "ep", "sp") and smap.mesh_axes == TOPOLOGY.AXES
        # every holder is a member of this rank's dense group, named by its mesh coordinates
        assert {smap.global_rank(p) for p in smap.pieces} <= set(members)
        assert all(members[p.rank] == smap.global_rank(p) for p in smap.pieces)
        if stage == 0:
            assert {p.rank for p in smap.pieces} == set(range(len(members)))
        # this rank's tp half (or the whole replicated tensor) is covered, nothing else
        tp_split = shard.name.startswith("0.")
        assert smap.missing_elements() == (smap.numel // 2 if tp_split else 0)
        master = zero.master_partitions[shard.group_index]
        reference = full.get(shard.name, torch.zeros(3)).reshape(-1)
        for piece in smap.pieces_of(group_rank):
            local = master[piece.local_offset : piece.local_offset + piece.numel]
            assert torch.equal(local, reference[list(smap.iter_global_flat(piece))])
        expected = [Replicate()] * 5
        if tp_split:
            expected[4] = Shard(0)
        if stage > 0:
            expected[1:4] = [FlatShard()] * 3
        assert shard.placement.placements == tuple(expected)
        assert shard.placement.dtype == "float32"


def _tp_zero(
    model: torch.nn.Module, dims: ParallelDims, registry: PlacementRegistry, *, stage: int = 1
) -> ZeroOptimizer:
    """ZeRO over tp-sharded placements: ``shard(parallel_dims=)`` (it needs the tp group)."""
    policy = ZeroPolicy(stage=stage, reduce_bucket_size=64)
    resident = zero_shard(model, parallel_dims=dims, policy=policy, placements=registry)
    config = ZeroConfig(stage=stage, reduce_bucket_size=64)
    return ZeroOptimizer(torch.optim.AdamW(model.parameters()), resident, config=config)


def _zero(model: torch.nn.Module, group: Any, registry: PlacementRegistry | None) -> ZeroOptimizer:
    return ZeroOptimizer(
        torch.optim.AdamW(model.parameters()),
        group=group,
        config=ZeroConfig(stage=1),
        named_parameters=model.named_parameters(),
        placements=registry,
    )


def test_expert_parameters_reduce_over_dp_alone(dims: ParallelDims) -> None:
    experts = torch.nn.Linear(4, 4)
    registry = PlacementRegistry.replicated(
        experts.named_parameters(), TOPOLOGY, reduce_over=Topology.expert_dp_axes
    )
    zero = _zero(experts, dims.expert_dp, registry)
    members = _members(dims.rank, ("dp",))
    holders = set()
    for shard in zero.shard_maps():
        assert shard.shard_map.axes == ("dp",) and shard.shard_map.missing_elements() == 0
        holders |= {shard.shard_map.global_rank(p) for p in shard.shard_map.pieces}
    assert holders == set(members)  # partitioned over the dp replicas, nobody else
    with pytest.raises(TopologyError, match=r"reduced over \('dp',\).*ParallelDims.group_over"):
        _zero(torch.nn.Linear(4, 4), dims.dense_dp, registry)


def test_placements_that_do_not_fit_are_refused(dims: ParallelDims) -> None:
    model = _tp_model(dims.coordinate["tp"])
    dense = _registry(model)
    # tp-sharded placements need the tp group for the norm: group= alone is refused
    with pytest.raises(ConfigError, match=r"over tp.*parallel_dims=dims"):
        _zero(model, dims.dense_dp, dense)
    unsplit = PlacementRegistry.replicated(model.named_parameters(), TOPOLOGY)
    unsplit.set(
        "0.weight",
        ParamPlacement.replicated((ROWS // 2, COLS), "float32").with_axis("tp", Shard(0)),
    )
    with pytest.raises(
        TopologyError, match=r"'0.weight' has shape \(6, 10\).*gives this rank \(3, 10\)"
    ):
        _tp_zero(model, dims, unsplit)
    partial = PlacementRegistry(TOPOLOGY, {"0.weight": dense["0.weight"]})
    with pytest.raises(TopologyError, match=r"'0\.bias' has no placement"):
        _tp_zero(model, dims, partial)
    mixed = _registry(model)
    mixed.set("1.bias", ParamPlacement.replicated((3,), "float32", reduce_over=("dp",)))
    # reduced over dp alone yet copied along ep: the norm would count it twice
    with pytest.raises(TopologyError, match=r"'1.bias' reduces over \('dp',\).*along 'ep'"):
        _tp_zero(model, dims, mixed)
    small = PlacementRegistry.replicated(model.named_parameters(), Topology(dp=2))
    with pytest.raises(TopologyError, match="covers 2 ranks but the world has 8"):
        _tp_zero(model, dims, small)
