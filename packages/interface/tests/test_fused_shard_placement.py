"""``Shard(dim, parts)``: a fused weight's placement, as pure arithmetic (no processes).

A fused ``gate_up_proj`` is gate rows then up rows; tensor parallelism gives rank ``t`` its
slice of each, stored back to back, so its local tensor is two boxes of the whole one. Stacked
experts (``[E, 2I, H]``, experts split over ``ep`` on dim 0, gate/up over ``tp`` on dim 1) store
one box per local expert and part. The expected storage is built here by slicing nested lists
part by part, independently of `ParamPlacement.local_boxes`.
"""

from __future__ import annotations

import itertools
import math

import pytest

from deepshard.interface import ParamPlacement, Shard, Topology
from deepshard.interface.errors import TopologyError


def _coords(topology: Topology, **at: int) -> dict[str, int]:
    return {axis: at.get(axis, 0) for axis in topology.axis_names}


def _elements(shape: tuple[int, ...], offset: tuple[int, ...], box: tuple[int, ...]) -> list[int]:
    """Row-major flat indices into ``shape`` of a box's elements, in row-major box order."""
    strides = [math.prod(shape[d + 1 :]) for d in range(len(shape))]
    return [
        sum((o + i) * s for o, i, s in zip(offset, index, strides, strict=True))
        for index in itertools.product(*(range(n) for n in box))
    ]


def _storage(placement: ParamPlacement, topology: Topology, coords: dict[str, int]) -> list[int]:
    boxes = placement.local_boxes(topology, coords)
    return [i for offset, box in boxes for i in _elements(placement.global_shape, offset, box)]


def test_gate_up_rank_stores_its_slice_of_each_half() -> None:
    topology = Topology(tp=2)
    placement = ParamPlacement.replicated((8, 3), "float32").with_axis("tp", Shard(0, (4, 4)))
    assert placement.local_shape(topology) == (4, 3)
    rows = [list(range(3 * r, 3 * r + 3)) for r in range(8)]
    for t in range(2):
        gate, up = rows[:4], rows[4:]
        want = [x for row in gate[2 * t : 2 * t + 2] + up[2 * t : 2 * t + 2] for x in row]
        assert _storage(placement, topology, _coords(topology, tp=t)) == want
    with pytest.raises(TopologyError, match="local_boxes"):
        placement.local_box(topology, _coords(topology, tp=1))


def test_uneven_parts_of_a_qkv_each_split_on_their_own() -> None:
    topology = Topology(tp=2)
    qkv = ParamPlacement.replicated((12, 2), "float32").with_axis("tp", Shard(0, (8, 2, 2)))
    boxes = qkv.local_boxes(topology, _coords(topology, tp=1))
    assert boxes == (((4, 0), (4, 2)), ((9, 0), (1, 2)), ((11, 0), (1, 2)))
    assert qkv.local_shape(topology) == (6, 2)


def test_stacked_experts_store_one_box_per_expert_and_part() -> None:
    topology = Topology(ep=2, tp=2)
    experts, inter, hidden = 4, 2, 3
    placement = (
        ParamPlacement.replicated((experts, 2 * inter, hidden), "float32", reduce_over=("dp",))
        .with_axis("ep", Shard(0))
        .with_axis("tp", Shard(1, (inter, inter)))
    )
    assert placement.local_shape(topology) == (2, 2, 3)
    full = [
        [[(e * 2 * inter + r) * hidden + h for h in range(hidden)] for r in range(2 * inter)]
        for e in range(experts)
    ]
    seen: list[int] = []
    for e, t in itertools.product(range(2), range(2)):
        mine = full[2 * e : 2 * e + 2]
        # per local expert: its gate rows' t-th half, then its up rows' t-th half
        halves = [x[:inter][t : t + 1] + x[inter:][t : t + 1] for x in mine]
        want = [v for expert in halves for row in expert for v in row]
        got = _storage(placement, topology, _coords(topology, ep=e, tp=t))
        assert got == want
        seen += got
    assert sorted(seen) == list(range(experts * 2 * inter * hidden))  # each element once


def test_json_keeps_the_parts_and_leaves_a_plain_shard_as_it_was() -> None:
    fused = ParamPlacement.replicated((8, 3), "float32").with_axis("tp", Shard(0, (4, 4)))
    assert ParamPlacement.from_json(fused.to_json()) == fused
    plain = ParamPlacement.replicated((8, 3), "float32").with_axis("tp", Shard(0))
    assert "parts" not in plain.to_json()["placements"][-1]


@pytest.mark.parametrize(
    ("split", "match"),
    [
        (Shard(0, (4, 3)), "adding up to dimension 0"),
        (Shard(0, (8, 0)), "positive extents"),
    ],
)
def test_bad_parts_are_refused(split: Shard, match: str) -> None:
    with pytest.raises(TopologyError, match=match):
        ParamPlacement.replicated((8, 3), "float32").with_axis("tp", split)


def test_a_part_that_does_not_split_and_a_shared_dim_are_refused() -> None:
    topology = Topology(tp=2)
    odd = ParamPlacement.replicated((6, 3), "float32").with_axis("tp", Shard(0, (3, 3)))
    with pytest.raises(TopologyError, match=r"parts \(3, 3\) of 0"):
        odd.local_shape(topology)
    base = ParamPlacement.replicated((8, 3), "float32", reduce_over=("dp",))
    with pytest.raises(TopologyError, match="cannot share dimension 0"):
        base.with_axis("ep", Shard(0)).with_axis("tp", Shard(0, (4, 4)))
