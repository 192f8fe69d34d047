"""Several reduction groups in one sharded model: what is not built is refused, by name.

Rank 1 of ``dp=2 × ep=2`` is played on a fake process group (no data moves; nothing here
reads values). The model has a dense layer and an expert layer whose placement reduces it over
``dp`` only. Stages 0-3 build one layout per group; every path not built for several groups —
``shard(group=...)``, a group reaching outside the dense axes, optimizer offload, Muon,
``GatheredParameters(modifier_rank=...)``, the params-only ``ZeroOptimizer(inner, group=...)``
— raises a typed error naming what to do instead. At every stage ``state_shards()`` is built:
the expert entries' maps span ``dp × ep`` with the dense group's ranks, like the dense ones
(the safe_* helpers are built too, tested on real ranks in deepshard's AutoEP checkpoint test).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from deepshard.comm import ParallelDims
from deepshard.interface import ParamPlacement, PlacementRegistry, Shard, Topology
from deepshard.interface.config import ZeroConfig
from deepshard.interface.errors import ConfigError, TopologyError
from deepshard.testing import fake_mesh
from deepshard.zero import (
    GatheredParameters,
    ZeroOptimizer,
    ZeroPolicy,
    shard,
)

TOPOLOGY = Topology(dp=2, ep=2)


@pytest.fixture
def dims() -> Iterator[ParallelDims]:
    with fake_mesh(TOPOLOGY, 1) as mesh:
        yield ParallelDims.from_mesh(mesh)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 8))


def _registry(model: torch.nn.Module, expert_axes: tuple[str, ...] = ("dp",)) -> PlacementRegistry:
    registry = PlacementRegistry.replicated([], TOPOLOGY)
    for name, param in model.named_parameters():
        if name.startswith("1."):  # the expert: rows of a stacked (2 experts) tensor
            shape = (2 * param.shape[0], *param.shape[1:])
            placement = ParamPlacement.replicated(shape, "float32", reduce_over=expert_axes)
            registry.set(name, placement.with_axis("ep", Shard(0)))
        else:
            registry.set(name, ParamPlacement.replicated(tuple(param.shape), "float32"))
    return registry


def test_stage3_plans_one_layout_per_group(dims: ParallelDims) -> None:
    model = _model()
    sharded = shard(model, parallel_dims=dims, placements=_registry(model))
    assert [(p.name, p.reduce_over, p.param_names) for p in sharded.plans] == [
        ("", (), ("0.weight", "0.bias")),
        ("", ("dp",), ("1.weight", "1.bias")),
    ]
    assert sharded.mixed_groups
    assert [u.world for u in sharded.units] == [4, 2]


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_stages_0_to_2_lay_out_each_group_and_refuse_the_rest(
    dims: ParallelDims, stage: int
) -> None:
    """Stages 0-2 build one layout per group (trained in test_stage012_expert_and_dense_groups);
    offload, Muon and the params-only form are refused; state_shards() is built, its expert
    maps spanning the dense group as at stage 3."""
    model = _model()
    policy = ZeroPolicy(stage=stage)
    resident = shard(model, parallel_dims=dims, policy=policy, placements=_registry(model))
    assert [(u.name, u.reduce_over, u.param_names) for u in resident.units] == [
        ("", (), ("0.weight", "0.bias")),
        ("", ("dp",), ("1.weight", "1.bias")),
    ]
    assert resident.mixed_groups
    assert [resident.unit_partition_count(u) for u in (0, 1)] == ([1, 1] if stage == 0 else [4, 2])
    inner = torch.optim.Adam(model.parameters(), lr=1e-3)
    if stage:
        offload = ZeroConfig(stage=stage, offload_optimizer={"device": "cpu"})
        with pytest.raises(ConfigError, match="offload_optimizer: not built"):
            ZeroOptimizer(inner, resident, config=offload)
    with pytest.raises(ConfigError, match="full_grad_transform: Muon is not built"):
        ZeroOptimizer(
            inner,
            resident,
            config=ZeroConfig(stage=stage),
            full_grad_transform=lambda grad, buffer, group: grad,
            transformed_params=list(model[0].parameters()),
        )
    zero = ZeroOptimizer(inner, resident, config=ZeroConfig(stage=stage))
    _expert_maps_span_the_dense_group(zero)
    with pytest.raises(TopologyError, match="reduce every parameter they wrap over one group"):
        fresh = _model()
        ZeroOptimizer(
            torch.optim.Adam(fresh.parameters()),
            group=dims.dense_dp,
            config=ZeroConfig(stage=stage),
            named_parameters=fresh.named_parameters(),
            placements=_registry(fresh),
        )


def test_group_argument_cannot_find_the_other_groups(dims: ParallelDims) -> None:
    model = _model()
    with pytest.raises(ConfigError, match="pass parallel_dims="):
        shard(model, group=dims.dense_dp, placements=_registry(model))


def test_a_group_outside_the_dense_axes_is_refused(dims: ParallelDims) -> None:
    model = _model()
    with pytest.raises(TopologyError, match="outside the dense data-parallel axes"):
        shard(model, parallel_dims=dims, placements=_registry(model, ("dp", "tp")))


def test_unbuilt_paths_are_refused(dims: ParallelDims) -> None:
    model = _model()
    sharded = shard(model, parallel_dims=dims, placements=_registry(model))
    inner = torch.optim.Adam(model.parameters(), lr=1e-3)
    offload = ZeroConfig(stage=3, offload_optimizer={"device": "cpu"})
    with pytest.raises(ConfigError, match="offload_optimizer: not built"):
        ZeroOptimizer(inner, sharded, config=offload)
    with pytest.raises(ConfigError, match="modifier_rank=0"):
        GatheredParameters(list(model.parameters()), modifier_rank=0)


def test_an_expert_replicated_along_a_left_out_axis_is_refused() -> None:
    """With sp = 2 an expert reduced over dp only is copied on both sp ranks: the one-all-reduce
    norm would count it twice, so it is refused naming the axis (at sp = 1 the same placements
    shard, as the tests above show)."""
    topology = Topology(dp=2, ep=2, sp=2)
    with fake_mesh(topology, 1) as mesh:
        dims = ParallelDims.from_mesh(mesh)
        model = _model()
        registry = PlacementRegistry.replicated([], topology)
        for name, param in model.named_parameters():
            shape = tuple(param.shape)
            if name.startswith("1."):
                shape = (2 * shape[0], *shape[1:])
                placement = ParamPlacement.replicated(shape, "float32", reduce_over=("dp",))
                registry.set(name, placement.with_axis("ep", Shard(0)))
            else:
                registry.set(name, ParamPlacement.replicated(shape, "float32"))
        with pytest.raises(TopologyError, match=r"replicated along 'sp' \(size 2\)"):
            shard(model, parallel_dims=dims, placements=registry)


def test_stage3_state_shards_span_the_dense_group(dims: ParallelDims) -> None:
    model = _model()
    sharded = shard(model, parallel_dims=dims, placements=_registry(model))
    zero = ZeroOptimizer(torch.optim.Adam(model.parameters()), sharded, config=ZeroConfig(stage=3))
    _expert_maps_span_the_dense_group(zero)


def _expert_maps_span_the_dense_group(zero: ZeroOptimizer) -> None:
    entries = {entry.key: entry for entry in zero.state_shards()}
    for name in ("0.weight", "1.weight", "1.bias"):
        smap = entries[f"{name}/master"].shard_map
        smap.validate_coverage()
        assert {p.rank for p in smap.pieces} <= set(range(4)), name
    expert = entries["1.weight/master"].shard_map
    assert expert.global_shape == (16, 8)
    assert expert.axes == ("dp", "ep")
    # rank 1 is (dp 0, ep 1): its pieces lie in the second expert's rows [8, 16)
    assert {p.box_offset for p in expert.pieces if p.rank == 1} == {(8, 0)}
