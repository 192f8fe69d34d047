"""Fused weights: ``gate_up_proj`` with ``shape [2, -1]`` and an uneven GQA fused QKV with
``shape [[q, k, v], -1]`` are split sub-parameter by sub-parameter.

The tiny Phi-3 (8 query and 2 KV heads of 8, fused ``qkv_proj`` of 64 + 16 + 16 rows) is
planned from explicit specs, the phi3 preset and, with its tp_plan removed, the heuristic. The
round trip takes each rank's shard of a weight whose rows are numbered (the concatenation of the
slices `LayerPlan.offsets` names), puts every piece back where it came from, and must give the
original order; every rank's query rows must belong to the KV heads it holds.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from deepshard.autotp import AutoTPWarning, LayerPlan, Style, kv_group_split, make_plan, split_sizes
from deepshard.interface.config import TensorParallelConfig
from deepshard.testing import import_beside

models = import_beside(__file__, "_models.py")

HEADS, KV_HEADS, HEAD_DIM = 8, 2, 8
Q, KV = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
QKV = "model.layers.0.self_attn.qkv_proj"
GATE_UP = "model.layers.0.mlp.gate_up_proj"


def _specs_config() -> TensorParallelConfig:
    return TensorParallelConfig(partition_config={"layer_specs": [
        {"patterns": [r".*\.qkv_proj\.weight$"], "shape": [[Q, KV, KV], -1], "partition_dim": 0},
        {"patterns": [r".*\.gate_up_proj\.weight$"], "shape": [2, -1], "partition_dim": 0},
        {"patterns": [r".*\.(o|down)_proj\.weight$"], "partition_type": "row"},
    ]})  # fmt: skip


def _round_trip(entry: LayerPlan, tp_size: int, rows: int) -> torch.Tensor:
    """Shards ``arange(rows)`` as the plan says, then reassembles it from the shards."""
    full = torch.arange(rows)
    shards = [torch.cat([full[s : s + n] for s, n in entry.offsets(r)]) for r in range(tp_size)]
    for rank, shard in enumerate(shards):
        assert shard.numel() == entry.local_size(rank)
    rebuilt = torch.full((rows,), -1)
    for rank, shard in enumerate(shards):
        pieces = shard.split([n for _, n in entry.offsets(rank)])
        for (start, length), piece in zip(entry.offsets(rank), pieces, strict=True):
            rebuilt[start : start + length] = piece
    return rebuilt


def _plans(tp_size: int) -> list[LayerPlan]:
    specs = make_plan(models.phi3(), tp_size, _specs_config())
    preset = make_plan(models.phi3(), tp_size, TensorParallelConfig(preset_model="phi3"))
    heuristic = make_plan(models.without_tp_plan(models.phi3()), tp_size)
    return [plan.layer(QKV) for plan in (specs, preset, heuristic)]  # type: ignore[misc]


@pytest.mark.parametrize("tp_size", [2, 4])
def test_uneven_gqa_qkv_splits_q_k_v_by_kv_groups_and_round_trips(tp_size: int) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        entries = _plans(tp_size)
    # Four ranks, two KV heads: ranks 2 and 3 hold no attention rows, and AutoTP says so.
    empty = [w for w in caught if issubclass(w.category, AutoTPWarning)]
    assert len(empty) == (3 if tp_size > KV_HEADS else 0)
    assert all("ranks 2-3 hold no attention rows" in str(w.message) for w in empty)
    for entry in entries:
        assert entry.style is Style.COLUMN
        assert entry.sizes == tuple(kv_group_split(n, tp_size, KV_HEADS) for n in (Q, KV, KV))
        assert torch.equal(_round_trip(entry, tp_size, Q + 2 * KV), torch.arange(Q + 2 * KV))
        for rank in range(tp_size):
            (q_start, q_len), (k_start, k_len), _ = entry.offsets(rank)
            q_heads = range(q_start // HEAD_DIM, (q_start + q_len) // HEAD_DIM)
            kv_heads = range((k_start - Q) // HEAD_DIM, (k_start - Q + k_len) // HEAD_DIM)
            assert {head // (HEADS // KV_HEADS) for head in q_heads} == set(kv_heads)


def test_gate_up_splits_gate_and_up_separately_and_round_trips() -> None:
    intermediate = models.SIZES["intermediate_size"]
    for plan in (
        make_plan(models.phi3(), 2, _specs_config()),
        make_plan(models.without_tp_plan(models.phi3()), 2),
    ):
        entry = plan.layer(GATE_UP)
        assert entry is not None
        half = split_sizes(intermediate, 2, kv_groups=None)
        assert entry.sizes == (half, half)
        # Rank 0 holds the first half of gate and the first half of up, in that order.
        assert entry.offsets(0) == ((0, half[0]), (intermediate, half[0]))
        assert torch.equal(_round_trip(entry, 2, 2 * intermediate), torch.arange(2 * intermediate))
