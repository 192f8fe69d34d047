"""Fused weights cut per sub-parameter: partition, then gather, gives the original order back.

A fused ``gate_up_proj`` (``shape=(2, -1)``) and an uneven GQA fused QKV (12 query heads, 3 KV
heads of 4 rows, on TP=2: KV heads 0-1 on rank 0, head 2 on rank 1, each query head with its
KV head) are partitioned with the plan's sizes, reassembled, and rebuilt from their shard maps
by the interface's ``rebuild``. The expected shards are built from head indices, not from the
plan's offsets.
"""

from __future__ import annotations

import pytest
import torch

from deepshard.autotp import LayerPlan, Style, sub_parameter_sizes
from deepshard.autotp._functions import assemble, local_pieces
from deepshard.autotp._placements import tp_shard_map
from deepshard.interface._shard_layout import rebuild
from deepshard.interface.errors import ConfigError

HEADS, KV_HEADS, HEAD_DIM, TP, HIDDEN = 12, 3, 4, 2, 5


def _qkv_plan() -> LayerPlan:
    parts = (HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM)
    sizes = sub_parameter_sizes(parts, TP, kv_groups=(KV_HEADS,) * 3)
    return LayerPlan("attn.qkv", Style.COLUMN, sizes)


def _rows_of_heads(heads: list[int], base: int) -> list[int]:
    return [base + h * HEAD_DIM + i for h in heads for i in range(HEAD_DIM)]


def test_uneven_gqa_qkv_shards_hold_whole_heads_and_gather_back() -> None:
    layer = _qkv_plan()
    weight = torch.randn(HEADS * HEAD_DIM + 2 * KV_HEADS * HEAD_DIM, HIDDEN)
    group_of_rank = [g.tolist() for g in torch.arange(KV_HEADS).tensor_split(TP)]
    per_group = HEADS // KV_HEADS
    shards = []
    for rank in range(TP):
        kv = group_of_rank[rank]
        q = [h for g in kv for h in range(g * per_group, (g + 1) * per_group)]
        k_base, v_base = HEADS * HEAD_DIM, HEADS * HEAD_DIM + KV_HEADS * HEAD_DIM
        rows = _rows_of_heads(q, 0) + _rows_of_heads(kv, k_base) + _rows_of_heads(kv, v_base)
        shard = local_pieces(weight, layer.offsets(rank), 0)
        assert torch.equal(shard, weight[rows]), rank
        shards.append(shard)
    assert [s.shape[0] for s in shards] == [32 + 8 + 8, 16 + 4 + 4]
    pieces = tuple(layer.offsets(r) for r in range(TP))
    assert torch.equal(assemble(shards, pieces, 0), weight)
    smap = tp_shard_map(tuple(weight.shape), "float32", layer, 0, TP)
    flat = {r: s.reshape(-1).tolist() for r, s in enumerate(shards)}
    assert torch.equal(torch.tensor(rebuild(smap, flat)).view_as(weight), weight)


@pytest.mark.parametrize("tp_size", [2, 3])
def test_fused_gate_up_shards_keep_gate_and_up_apart(tp_size: int) -> None:
    inter = 6
    sizes = sub_parameter_sizes((inter, inter), tp_size, kv_groups=(None, None))
    layer = LayerPlan("mlp.gate_up_proj", Style.COLUMN, sizes)
    weight = torch.randn(2 * inter, HIDDEN)
    bias = torch.randn(2 * inter)
    gate, up = weight[:inter], weight[inter:]
    shards = []
    for rank in range(tp_size):
        shard = local_pieces(weight, layer.offsets(rank), 0)
        local_gate, local_up = shard.chunk(2)  # what a fused MLP's forward does locally
        assert torch.equal(local_gate, gate.tensor_split(tp_size)[rank])
        assert torch.equal(local_up, up.tensor_split(tp_size)[rank])
        shards.append(shard)
    pieces = tuple(layer.offsets(r) for r in range(tp_size))
    assert torch.equal(assemble(shards, pieces, 0), weight)
    bias_shards = [local_pieces(bias, layer.offsets(r), 0) for r in range(tp_size)]
    assert torch.equal(assemble(bias_shards, pieces, 0), bias)
    for full, parts in ((weight, shards), (bias, bias_shards)):
        smap = tp_shard_map(tuple(full.shape), "float32", layer, 0, tp_size)
        flat = {r: s.reshape(-1).tolist() for r, s in enumerate(parts)}
        assert torch.equal(torch.tensor(rebuild(smap, flat)).view_as(full), full)


def test_a_fused_weight_split_along_dim_1_has_no_shard_map() -> None:
    layer = LayerPlan("mlp.fused_down", Style.ROW, ((3, 3), (3, 3)))
    with pytest.raises(ConfigError, match="partition_type 'column'"):
        tp_shard_map((4, 12), "float32", layer, 1, 2)


@pytest.mark.parametrize("kv_heads", [2, 3], ids=["even", "uneven"])
def test_even_fused_split_has_a_placement_whose_boxes_are_the_shard_map(kv_heads: int) -> None:
    """A fused QKV whose KV heads divide gets ``Shard(0, parts)``, each rank's boxes exactly its
    shard map's pieces in order (what ZeRO and the checkpoint then agree on); one whose KV heads
    do not divide gets no `Shard` placement (the engine refuses it by name)."""
    from deepshard.autotp._placements import even_split
    from deepshard.interface import ParamPlacement, Topology

    parts = (HEADS * HEAD_DIM, kv_heads * HEAD_DIM, kv_heads * HEAD_DIM)
    sizes = sub_parameter_sizes(parts, TP, kv_groups=(kv_heads,) * 3)
    layer = LayerPlan("attn.qkv", Style.COLUMN, sizes)
    split = even_split(layer, 0)
    if kv_heads == 3:
        assert split is None
        return
    assert split is not None and split.parts == parts
    shape = (sum(parts), HIDDEN)
    placement = ParamPlacement.replicated(shape, "float32").with_axis("tp", split)
    smap = tp_shard_map(shape, "float32", layer, 0, TP)
    topology = Topology(tp=TP)
    for rank in range(TP):
        coords = {axis: rank if axis == "tp" else 0 for axis in topology.axis_names}
        pieces = sorted(smap.pieces_of(rank), key=lambda p: p.local_offset)
        assert placement.local_boxes(topology, coords) == tuple(
            (p.box_offset, p.box_shape) for p in pieces
        )
