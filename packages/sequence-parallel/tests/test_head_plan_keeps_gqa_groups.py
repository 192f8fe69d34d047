"""The head plan: which query and KV heads each rank computes, and the splits it refuses.

Pure functions of the counts, plus `DistributedAttention` refusing bad input before any
collective (on PyTorch's fake process group, in this process).
"""

from __future__ import annotations

import pytest
import torch

from deepshard.interface import Topology
from deepshard.interface.errors import ConfigError
from deepshard.sequence_parallel import DistributedAttention, HeadPlan, plan_heads
from deepshard.testing import fake_mesh


def _kv_head_of_each_query_head(plan: HeadPlan, hq: int, hkv: int) -> list[bool]:
    """For every rank: do its query heads all use a KV head that the rank holds?"""
    group = hq // hkv
    ok, q0, kv0 = [], 0, 0
    for nq, nkv in zip(plan.q_splits, plan.kv_splits, strict=True):
        held = {(kv0 + j) // plan.kv_repeat for j in range(nkv)}
        ok.append(all((q0 + i) // group in held for i in range(nq)))
        q0, kv0 = q0 + nq, kv0 + nkv
    return ok


@pytest.mark.parametrize(
    ("hq", "hkv", "world", "q_splits", "kv_splits", "repeat"),
    [
        (8, 2, 2, (4, 4), (1, 1), 1),
        (8, 8, 2, (4, 4), (4, 4), 1),
        (6, 3, 2, (4, 2), (2, 1), 1),
        (7, 7, 4, (2, 2, 2, 1), (2, 2, 2, 1), 1),
        (8, 2, 4, (2, 2, 2, 2), (1, 1, 1, 1), 2),
        (4, 1, 4, (1, 1, 1, 1), (1, 1, 1, 1), 4),
    ],
)
def test_plan_keeps_each_query_head_with_its_kv_head(
    hq: int,
    hkv: int,
    world: int,
    q_splits: tuple[int, ...],
    kv_splits: tuple[int, ...],
    repeat: int,
) -> None:
    plan = plan_heads(hq, hkv, world)
    assert plan == HeadPlan(q_splits, kv_splits, repeat)
    assert sum(plan.q_splits) == hq and sum(plan.kv_splits) == hkv * repeat
    assert all(_kv_head_of_each_query_head(plan, hq, hkv))


@pytest.mark.parametrize(
    ("hq", "hkv", "world", "needle"),
    [
        (6, 2, 4, "cannot be split"),  # 4 % 2 == 0, but 3 query heads per KV head over 2 ranks
        (9, 3, 4, "cannot be split"),  # 4 ranks do not divide by 3 KV heads
        (8, 3, 2, "not a multiple"),
        (0, 1, 2, "positive"),
    ],
)
def test_impossible_split_is_a_config_error(hq: int, hkv: int, world: int, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        plan_heads(hq, hkv, world)


def test_attention_refuses_bad_input_before_communicating() -> None:
    q = torch.zeros(1, 2, 9, 4)
    kv = torch.zeros(1, 2, 3, 4)
    with fake_mesh(Topology(dp=4), rank=1) as mesh:
        attn = DistributedAttention(lambda q, k, v: q, mesh["dp"])
        assert attn.world_size == 4
        with pytest.raises(ConfigError, match="cannot be split over 4"):
            attn(q, kv, kv, 0)
        with pytest.raises(ConfigError, match="batch_dim_idx"):
            attn(q, kv, kv, 2)
        with pytest.raises(ConfigError, match="num_kv_heads=2"):
            DistributedAttention(lambda q, k, v: q, mesh["dp"], num_kv_heads=2)(q, kv, kv, 0)
        with pytest.raises(ConfigError, match="scatter_idx=1"):
            DistributedAttention(lambda q, k, v: q, mesh["dp"], scatter_idx=1)
        with pytest.raises(ConfigError, match="layout of its q"):
            DistributedAttention(lambda q, k, v: q.transpose(1, 2), mesh)(q, kv, kv, 0)
        # The whole mesh stands for its "sp" axis (size 1 here), not for the world.
        assert DistributedAttention(lambda q, k, v: q, mesh).world_size == 1
