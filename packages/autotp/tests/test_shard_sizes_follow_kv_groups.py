"""Shard sizes as pure functions: KV-head groups, grains, and more ranks than KV heads.

Expected sizes are derived independently with ``torch.tensor_split`` (which also gives the
first ranks the extra pieces), applied to the list of groups or grains, never copied numbers.
"""

from __future__ import annotations

import pytest
import torch

from deepshard.autotp import grain_split, kv_group_split, split_sizes, sub_parameter_sizes
from deepshard.interface.errors import ConfigError


def _groups_per_rank(groups: int, tp_size: int) -> list[int]:
    return [len(piece) for piece in torch.arange(groups).tensor_split(tp_size)]


def test_the_issue_example_three_kv_heads_of_64_on_two_ranks() -> None:
    assert kv_group_split(192, 2, 3) == (128, 64)


@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "tp_size"),
    [(12, 3, 64, 2), (8, 2, 8, 2), (8, 8, 8, 4), (32, 8, 4, 3), (6, 3, 4, 4)],
)
def test_query_rows_follow_their_kv_groups(
    heads: int, kv_heads: int, head_dim: int, tp_size: int
) -> None:
    q_sizes = kv_group_split(heads * head_dim, tp_size, kv_heads)
    k_sizes = kv_group_split(kv_heads * head_dim, tp_size, kv_heads)
    expected = _groups_per_rank(kv_heads, tp_size)
    assert list(k_sizes) == [count * head_dim for count in expected]
    q_per_kv = heads // kv_heads
    q_start = k_start = 0
    for q_rows, k_rows in zip(q_sizes, k_sizes, strict=True):
        # The KV heads of every query head a rank holds are exactly the KV heads it holds.
        q_groups = {
            head // q_per_kv for head in range(q_start // head_dim, (q_start + q_rows) // head_dim)
        }
        k_groups = set(range(k_start // head_dim, (k_start + k_rows) // head_dim))
        assert q_groups == k_groups
        q_start, k_start = q_start + q_rows, k_start + k_rows
    assert q_start == heads * head_dim


@pytest.mark.parametrize(
    ("total", "tp_size", "grain"),
    [(128, 2, 1), (130, 4, 1), (320, 4, 64), (200, 2, 64), (96, 3, 8)],
)
def test_grain_splits_give_whole_grains_to_the_first_ranks(
    total: int, tp_size: int, grain: int
) -> None:
    grains = total // grain
    expected = [count * grain for count in _groups_per_rank(grains, tp_size)]
    expected[-1] += total - grains * grain  # the tail shorter than a grain: the last rank
    sizes = grain_split(total, tp_size, grain)
    assert list(sizes) == expected
    assert sum(sizes) == total
    assert all(size % grain == 0 for size in sizes[:-1])


def test_more_ranks_than_kv_heads_leave_trailing_ranks_empty() -> None:
    # 2 KV heads of 16 over 4 ranks: one head each on ranks 0 and 1, nothing on 2 and 3.
    assert kv_group_split(32, 4, 2) == tuple(n * 16 for n in _groups_per_rank(2, 4))
    assert kv_group_split(32, 4, 2)[2:] == (0, 0)


def test_split_sizes_uses_groups_only_for_whole_groups() -> None:
    assert split_sizes(192, 2, kv_groups=3) == kv_group_split(192, 2, 3)
    # 100 rows are not made of 3 groups: the grain rule applies.
    assert split_sizes(100, 2, kv_groups=3) == grain_split(100, 2)
    assert split_sizes(128, 2, kv_groups=None, grain=32) == grain_split(128, 2, 32)


def test_fused_weights_split_each_sub_parameter_on_its_own() -> None:
    gate_up = sub_parameter_sizes((128, 128), 2, kv_groups=(None, None))
    assert gate_up == (grain_split(128, 2), grain_split(128, 2))
    q, kv = 12 * 64, 3 * 64
    qkv = sub_parameter_sizes((q, kv, kv), 2, kv_groups=(3, 3, 3))
    assert qkv == (kv_group_split(q, 2, 3), kv_group_split(kv, 2, 3), kv_group_split(kv, 2, 3))


def test_impossible_splits_name_the_tp_size_key() -> None:
    with pytest.raises(ConfigError, match=r"tensor_parallel\.autotp_size") as caught:
        grain_split(64, 4, 64, name="lm_head")
    assert "lm_head" in str(caught.value)
    assert caught.value.problems[0][0] == "tensor_parallel.autotp_size"
    with pytest.raises(ConfigError, match=r"tensor_parallel\.autotp_size"):
        kv_group_split(64, 0, 2)
    with pytest.raises(ConfigError, match="layer_specs"):
        kv_group_split(100, 2, 3)
