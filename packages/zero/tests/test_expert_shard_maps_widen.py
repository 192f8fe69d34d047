"""`deepshard.zero._tp_maps.expert_widened_entries`: stage-3 expert entries (maps over ``dp``)
widened over ``ep`` so they span the dense group, as pure data (no processes).

An expert weight of global shape 4 × 3 (4 experts, ``Shard(0)`` on ``ep``) on DP 2 × EP 2:
each ep rank holds 2 experts (a 2 × 3 box) and ZeRO cuts its 6 elements at 4 over ``dp``. The
widened map must hold every element exactly once with dense-group ranks (``dp · 2 + ep``);
a dense entry (already over ``dp × ep × sp``) and the scalar are left as they are.
"""

from __future__ import annotations

import torch

from deepshard.interface import ParamPlacement, Shard, ShardMap, ShardPiece, Topology
from deepshard.zero import StateShard
from deepshard.zero._tp_maps import expert_widened_entries

TOPOLOGY = Topology(dp=2, ep=2)
EXPERT = ParamPlacement.replicated((4, 3), "float32", reduce_over=("dp",)).with_axis("ep", Shard(0))


def _coords(dp: int, ep: int) -> tuple[int, ...]:
    named = {"pp": 0, "dp": dp, "ep": ep, "sp": 0, "tp": 0}
    return tuple(named[a] for a in TOPOLOGY.axis_names)


def _expert_map(ep: int) -> ShardMap:
    pieces = []
    for dp, (start, stop) in enumerate(((0, 4), (4, 6))):
        coords = _coords(dp, ep)
        offset, box = EXPERT.local_box(
            TOPOLOGY, dict(zip(TOPOLOGY.axis_names, coords, strict=True))
        )
        pieces.append(ShardPiece(dp, offset, box, start, stop, 0, coords))
    return ShardMap((4, 3), "float32", tuple(pieces), ("dp",), TOPOLOGY.axis_names, TOPOLOGY.shape)


def _dense_map() -> ShardMap:
    pieces = tuple(
        ShardPiece(
            2 * dp + ep, (0,), (8,), 2 * (2 * dp + ep), 2 * (2 * dp + ep) + 2, 0, _coords(dp, ep)
        )
        for dp in range(2)
        for ep in range(2)
    )
    return ShardMap(
        (8,), "float32", pieces, ("dp", "ep", "sp"), TOPOLOGY.axis_names, TOPOLOGY.shape
    )


def test_expert_map_spans_every_ep_rank_once_and_dense_maps_are_kept() -> None:
    dense = StateShard("dense.weight", "master", _dense_map(), torch.zeros(2))
    for ep in range(2):
        expert = StateShard("experts.w", "master", _expert_map(ep), torch.zeros(4))
        wide, kept = expert_widened_entries([expert, dense], {"experts.w": EXPERT})
        assert kept is dense
        smap = wide.shard_map
        assert smap.axes == ("dp", "ep")
        smap.validate_coverage()
        holders = {(p.rank, p.box_offset, p.flat_start) for p in smap.pieces}
        # rank = dp * 2 + ep; ep coordinate e holds experts [2e, 2e + 2)
        assert holders == {(0, (0, 0), 0), (1, (2, 0), 0), (2, (0, 0), 4), (3, (2, 0), 4)}
        full = [float(i) for i in range(12)]
        shards = {r: smap.extract(full, r) for r in range(4)}
        assert shards[1] == [6.0, 7.0, 8.0, 9.0]  # expert 2, then the first of expert 3
        assert smap.rebuild(shards) == full
