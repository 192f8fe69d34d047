"""Shard-map constructors round-trip through extract and rebuild; bad maps are refused.

The full tensor holds distinct values, and each rank's expected storage is cut by hand-written
slicing of nested lists (not by the map's own arithmetic), so a wrong offset shows up.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from deepshard.interface.errors import CheckpointError
from deepshard.interface.shard_map import ShardMap, ShardPiece


def _grid(rows: int, cols: int) -> list[list[float]]:
    return [[float(r * 100 + c) for c in range(cols)] for r in range(rows)]


def _flat(grid: list[list[float]]) -> list[float]:
    return [v for row in grid for v in row]


def _round_trip(smap: ShardMap, full: list[float], world: int) -> dict[int, list[float]]:
    shards = {rank: smap.extract(full, rank) for rank in range(world)}
    smap.validate_coverage(shards)
    assert smap.rebuild(shards) == full
    restored = ShardMap.from_json(json.loads(json.dumps(smap.to_json())))
    assert restored == smap
    return shards


def test_uneven_split_on_dim0() -> None:
    grid = _grid(7, 3)
    smap = ShardMap.contiguous_split((7, 3), "float32", dim=0, sizes=[3, 0, 4])
    shards = _round_trip(smap, _flat(grid), 3)
    assert shards == {0: _flat(grid[:3]), 1: [], 2: _flat(grid[3:])}


def test_uneven_split_on_dim1() -> None:
    grid = _grid(3, 5)
    smap = ShardMap.contiguous_split((3, 5), "float32", dim=1, sizes=[2, 3])
    shards = _round_trip(smap, _flat(grid), 2)
    assert shards[0] == [v for row in grid for v in row[:2]]
    assert shards[1] == [v for row in grid for v in row[2:]]


def test_fused_qkv_sub_parameter() -> None:
    # q has 4 rows, k and v 3 each (uneven over 2 ranks: 2+1 rows), 2 columns.
    grid = _grid(10, 2)
    smap = ShardMap.sub_parameter((10, 2), "bfloat16", dim=0, parts=[4, 3, 3], world_size=2)
    shards = _round_trip(smap, _flat(grid), 2)
    q, k, v = grid[:4], grid[4:7], grid[7:]
    assert shards[0] == _flat(q[:2] + k[:2] + v[:2])
    assert shards[1] == _flat(q[2:] + k[2:] + v[2:])


def test_sub_parameter_across_columns_is_refused() -> None:
    with pytest.raises(CheckpointError, match="interleaves"):
        ShardMap.sub_parameter((4, 6), "float32", dim=1, parts=[3, 3], world_size=2)


def test_zero_flat_range_straddles_two_parameters() -> None:
    a, b = _grid(2, 3), _grid(1, 5)  # 6 + 5 = 11 elements, alignment 2 -> 6 + 6 = 12, 2 x 6
    map_a, map_b = ShardMap.flat_buffer([(2, 3), (1, 5)], "float32", world_size=3, alignment=2)
    # partitions of 4: rank 0 [0, 4) of a; rank 1 a[4:6] then b[0:2]; rank 2 b[2:5] (+1 pad)
    assert [p.rank for p in map_a.pieces] == [0, 1]
    assert [(p.rank, p.local_offset) for p in map_b.pieces] == [(1, 2), (2, 0)]
    shards_a = _round_trip(map_a, _flat(a), 3)
    shards_b = _round_trip(map_b, _flat(b), 3)
    assert shards_a[1][:2] == _flat(a)[4:6]
    assert shards_b[1][2:] == _flat(b)[:2]
    assert shards_b[2] == _flat(b)[2:]


def test_replicated_with_scale_half() -> None:
    full = [1.0, -2.0, 3.5, 8.0]
    smap = ShardMap.replicated((2, 2), "float32", ranks=[0, 1], scale=0.5)
    shards = _round_trip(smap, full, 2)
    assert shards[0] == shards[1] == [0.5, -1.0, 1.75, 4.0]


def test_holder_ranks_for_replicas() -> None:
    piece = ShardPiece(0, (0,), (4,), replicas=(2, 3))
    smap = ShardMap((4,), "float32", (piece,))
    assert smap.pieces_of(3) == (piece,)
    shards = _round_trip(smap, [1.0, 2.0, 3.0, 4.0], 4)
    assert shards[1] == []


def test_gap_is_rejected() -> None:
    smap = ShardMap.contiguous_split((5, 2), "float32", dim=0, sizes=[2, 3])
    holed = replace(smap, pieces=(smap.pieces[0], replace(smap.pieces[1], flat_start=1)))
    with pytest.raises(CheckpointError, match="no rank holds global element 4"):
        holed.validate_coverage()


def test_overlap_is_rejected() -> None:
    left = ShardPiece(0, (0, 0), (3, 2))
    right = ShardPiece(1, (2, 0), (2, 2))
    with pytest.raises(CheckpointError, match="overlap at global element 4"):
        ShardMap((4, 2), "float32", (left, right)).validate_coverage()


def test_mismatched_replicas_are_rejected() -> None:
    smap = ShardMap.replicated((3,), "float32", ranks=[0, 1])
    with pytest.raises(CheckpointError, match="different values"):
        smap.validate_coverage({0: [1.0, 2.0, 3.0], 1: [1.0, 2.0, 3.5]})
    mixed = replace(smap, pieces=(smap.pieces[0], replace(smap.pieces[1], scale=0.5)))
    with pytest.raises(CheckpointError, match="different scales"):
        mixed.validate_coverage()


def test_scale_zero_is_rejected() -> None:
    with pytest.raises(CheckpointError, match="zero or non-finite scale"):
        ShardMap.replicated((2,), "float32", ranks=[0], scale=0.0)


def test_optimizer_state_through_a_scaled_piece_is_refused() -> None:
    smap = ShardMap.replicated((2,), "float32", ranks=[0, 1], scale=0.5)
    with pytest.raises(CheckpointError, match="optimizer state"):
        smap.extract([1.0, 2.0], 0, linear=False)
    with pytest.raises(CheckpointError, match="optimizer state"):
        smap.rebuild({0: [0.5, 1.0]}, linear=False)
    plain = ShardMap.replicated((2,), "float32", ranks=[0, 1])
    assert plain.rebuild({1: [1.0, 2.0]}, linear=False) == [1.0, 2.0]


def test_json_carries_a_format_version() -> None:
    data = ShardMap.contiguous_split((4,), "float32", dim=0, sizes=[1, 3]).to_json()
    assert data["format_version"] == 2
    with pytest.raises(CheckpointError, match="format_version 99"):
        ShardMap.from_json({**data, "format_version": 99})


def test_scalar_tensor_round_trips() -> None:
    _round_trip(ShardMap.replicated((), "float32", ranks=[0]), [7.0], 1)
