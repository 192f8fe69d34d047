"""Stage 3 without processes: unit planning, `shard_info`, the policy's keys, and bad input.

Rank 1 of 2 is played on a fake process group (no data moves; only shapes and bookkeeping are
checked here; the values are checked by the 2-rank tests).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from deepshard.interface import ConfigError, DeepShardConfig, Topology
from deepshard.interface.config import ZeroConfig
from deepshard.testing import fake_mesh
from deepshard.zero import (
    ShardedModule,
    ZeroOptimizer,
    ZeroPolicy,
    build_zero_optimizer,
    register_external_parameter,
    shard,
)


@pytest.fixture
def mesh() -> Iterator[Any]:
    with fake_mesh(Topology(dp=2), 1) as mesh:
        yield mesh


class Blocks(torch.nn.Module):
    """An embedding, two blocks in a ModuleList, and a head tied to the embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(11, 6)
        self.blocks = torch.nn.ModuleList([torch.nn.Linear(6, 6), torch.nn.Linear(6, 6)])
        self.head = torch.nn.Linear(6, 11, bias=False)
        self.head.weight = self.embed.weight


def test_units_own_their_parameters_and_tied_ones_belong_to_the_first_owner(mesh: Any) -> None:
    model = Blocks()
    sharded = shard(model, parallel_dims=None, group=mesh["dp"])
    assert [(p.name, p.param_names) for p in sharded.plans] == [
        ("", ("embed.weight",)),  # the head's tied weight is the embedding's, owned once
        ("blocks.0", ("blocks.0.weight", "blocks.0.bias")),
        ("blocks.1", ("blocks.1.weight", "blocks.1.bias")),
    ]
    assert model.head.weight is model.embed.weight  # the model keeps its objects
    assert all(p.numel() == 0 for p in model.parameters())  # released
    info = sharded.shard_info(model.blocks[0].weight)
    assert (info.shape, info.numel, info.dtype) == ((6, 6), 36, torch.float32)
    # unit blocks.0: weight 36, bias at 36..42, padded to 48; rank 1 holds elements 24..48
    assert (info.flat_start, info.flat_stop, info.local_offset) == (24, 36, 0)
    bias = sharded.shard_info(model.blocks[0].bias)
    assert (bias.flat_start, bias.flat_stop, bias.local_offset) == (0, 6, 12)
    pieces = info.shard.shard_map.pieces
    assert [(p.rank, p.flat_start, p.flat_stop) for p in pieces] == [(0, 0, 24), (1, 24, 36)]
    assert sharded.units[1].partition.numel() == 24


def test_unit_classes_and_rule_override_the_default(mesh: Any) -> None:
    by_class = shard(
        Blocks(), group=mesh["dp"], policy=ZeroPolicy(unit_classes=(torch.nn.Embedding,))
    )
    assert [p.name for p in by_class.plans] == ["", "embed"]
    by_rule = shard(
        Blocks(), group=mesh["dp"], policy=ZeroPolicy(unit_rule=lambda name, _: name == "blocks.1")
    )
    assert [p.name for p in by_rule.plans] == ["", "blocks.1"]


def test_policy_reads_deepspeed_keys() -> None:
    config = DeepShardConfig.from_dict(
        {
            "zero_optimization": {
                "stage": 3,
                "stage3_prefetch_bucket_size": 123,
                "stage3_max_live_parameters": 456,
                "stage3_max_reuse_distance": 7,
                "stage3_param_persistence_threshold": 8,
                "reduce_bucket_size": 99,
            }
        }
    )
    policy = ZeroPolicy.from_config(config.zero_optimization)
    assert (policy.prefetch_bucket_size, policy.max_live_parameters) == (123, 456)
    assert (policy.max_reuse_distance, policy.param_persistence_threshold) == (7, 8)
    assert policy.reduce_bucket_size == 99
    assert policy.overlap_comm  # DeepSpeed's stage-3 default
    with pytest.raises(ConfigError, match="stage3_max_live_parameters"):
        ZeroPolicy(max_live_parameters=-1)


def test_bad_input_gets_typed_errors_naming_the_fix(mesh: Any) -> None:
    model = Blocks()
    sharded = shard(model, group=mesh["dp"])
    with pytest.raises(ConfigError, match="already sharded"):
        shard(model, group=mesh["dp"])
    with pytest.raises(ConfigError, match="exactly one of parallel_dims"):
        shard(Blocks())
    stranger = torch.nn.Linear(2, 2)
    with pytest.raises(ConfigError, match="not a parameter of this sharded module"):
        ZeroOptimizer(torch.optim.SGD(stranger.parameters(), lr=0.1), sharded)
    other = torch.distributed.new_group([0, 1])
    with pytest.raises(ConfigError, match="group other than its ShardedModule's"):
        ZeroOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), sharded, group=other)
    with pytest.raises(ConfigError, match=r"zero_optimization\.stage"):
        ZeroOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), sharded, config=ZeroConfig(stage=2)
        )
    with pytest.raises(ConfigError, match="ZeroOptimizer\\(inner, sharded_module\\)"):
        ZeroOptimizer(
            torch.optim.SGD(Blocks().parameters(), lr=0.1),
            group=mesh["dp"],
            config=ZeroConfig(stage=3),
        )
    with pytest.raises(ConfigError, match="sharded_module"):
        build_zero_optimizer(
            torch.optim.SGD(Blocks().parameters(), lr=0.1),
            DeepShardConfig.from_dict({"zero_optimization": {"stage": 3}}),
            group=mesh["dp"],
        )
    with pytest.raises(ConfigError, match="not a unit"):
        register_external_parameter(model.head, model.blocks[0].weight)
    with pytest.raises(ConfigError, match="not a parameter"):
        sharded.register_external_parameter(model.blocks[1], stranger.weight)
    assert isinstance(sharded, ShardedModule)
