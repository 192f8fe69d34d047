"""Shard maps describe exactly the elements each rank stores (checked without torch)."""

from __future__ import annotations

import itertools
import json
from dataclasses import replace

import pytest

from deepshard.interface.errors import CheckpointError
from deepshard.interface.shard_map import ShardMap, ShardPiece


def _values(smap: ShardMap, piece: ShardPiece) -> list[int]:
    # The global tensor holds its own row-major index, so a piece's values are its flat indices.
    return list(smap.iter_global_flat(piece))


def test_even_split_along_columns_matches_slicing() -> None:
    rows, cols, world = 4, 6, 3
    grid = [[r * cols + c for c in range(cols)] for r in range(rows)]
    smap = ShardMap.even_split((rows, cols), "float32", dim=1, world_size=world)
    width = cols // world
    for rank in range(world):
        (piece,) = smap.pieces_of(rank)
        expected = [
            grid[r][c] for r in range(rows) for c in range(rank * width, (rank + 1) * width)
        ]
        assert _values(smap, piece) == expected
    assert smap.missing_elements() == 0


def test_flat_partition_straddles_rows() -> None:
    shape = (5, 7)  # 35 elements cut at 12 and 24: both cuts fall inside a row
    bounds = [(0, 0, 12), (1, 12, 24), (2, 24, 35)]
    smap = ShardMap.flat_partition(shape, "bfloat16", bounds=bounds)
    for rank, start, stop in bounds:
        (piece,) = smap.pieces_of(rank)
        assert _values(smap, piece) == list(range(start, stop))
        assert piece.global_index(0) == divmod(start, shape[1])
    assert smap.missing_elements() == 0


def test_tensor_parallel_box_then_zero_range_composes() -> None:
    shape = (4, 6)
    # TP rank holds rows 2..3 (a 2x6 box); ZeRO then keeps elements 5..9 of that box.
    piece = ShardPiece(rank=1, box_offset=(2, 0), box_shape=(2, 6), flat_start=5, flat_stop=10)
    smap = ShardMap(shape, "float32", (piece,))
    box_flat = [(r, c) for r, c in itertools.product(range(2, 4), range(6))]
    expected = [r * 6 + c for r, c in box_flat[5:10]]
    assert _values(smap, piece) == expected
    assert smap.missing_elements() == 24 - 5


def test_replicated_and_json_round_trip() -> None:
    smap = ShardMap.replicated((3, 2), "float16", ranks=[0, 1])
    restored = ShardMap.from_json(json.loads(json.dumps(smap.to_json())))
    assert restored == ShardMap(
        smap.global_shape,
        smap.dtype,
        tuple(ShardPiece(p.rank, p.box_offset, p.box_shape, 0, 6) for p in smap.pieces),
    )
    assert all(_values(restored, p) == list(range(6)) for p in restored.pieces)


@pytest.mark.parametrize(
    ("piece", "message"),
    [
        (ShardPiece(0, (0, 4), (2, 3), 0, None), "outside the tensor's extent 6"),
        (ShardPiece(0, (0,), (2,), 0, None), "has 1 dims"),
        (ShardPiece(0, (0, 0), (2, 3), 4, 9), "outside its box of 6 elements"),
    ],
)
def test_out_of_bounds_pieces_are_refused(piece: ShardPiece, message: str) -> None:
    with pytest.raises(CheckpointError, match=message):
        ShardMap((2, 6), "float32", (piece,))


def test_malformed_json_is_a_checkpoint_error() -> None:
    with pytest.raises(CheckpointError, match="malformed"):
        ShardMap.from_json({"global_shape": [2], "pieces": [{"rank": 0}]})


def test_uneven_split_is_refused() -> None:
    with pytest.raises(CheckpointError, match="does not split evenly"):
        ShardMap.even_split((5, 2), "float32", dim=0, world_size=2)


def test_global_index_rejects_outside_piece() -> None:
    with pytest.raises(IndexError):
        ShardPiece(0, (0,), (4,), 1, 3).global_index(2)


def test_negative_dim_counts_from_the_end() -> None:
    assert ShardMap.even_split((4, 6), "float32", dim=-1, world_size=3) == ShardMap.even_split(
        (4, 6), "float32", dim=1, world_size=3
    )


@pytest.mark.parametrize(("dim", "world", "message"), [(2, 2, "out of range"), (0, 0, ">= 1")])
def test_bad_split_arguments_are_checkpoint_errors(dim: int, world: int, message: str) -> None:
    with pytest.raises(CheckpointError, match=message):
        ShardMap.even_split((4, 6), "float32", dim=dim, world_size=world)


def _mesh_map(coords_of: dict[int, tuple[int, ...]]) -> ShardMap:
    """A tp-split (4, 6) tensor on a dp=2 × tp=2 mesh, pieces spread over dp by coordinate."""
    pieces = tuple(
        ShardPiece(coords[0], (0, 3 * coords[1]), (4, 3), 0, 12, coords=coords)
        for coords in coords_of.values()
    )
    return ShardMap((4, 6), "float32", pieces, ("dp",), ("dp", "tp"), (2, 2))


def test_pieces_carry_one_coordinate_per_mesh_axis() -> None:
    coords = {rank: divmod(rank, 2) for rank in range(4)}  # row-major (dp, tp), tp fastest
    smap = _mesh_map(coords)
    assert [smap.global_rank(p) for p in smap.pieces] == [0, 1, 2, 3]
    assert smap.missing_elements() == 0
    restored = ShardMap.from_json(json.loads(json.dumps(smap.to_json())))
    assert restored == smap and restored.pieces[3].coords == (1, 1)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"coords": (1, 0, 0)}, "not one coordinate inside each axis"),
        ({"coords": (0, 2)}, "not one coordinate inside each axis"),
        ({"rank": 1}, "which are rank 0 of the group over"),
    ],
)
def test_coordinates_must_fit_the_mesh_and_the_group_rank(
    change: dict[str, object], message: str
) -> None:
    piece = ShardPiece(0, (0, 0), (4, 3), coords=(0, 0))
    with pytest.raises(CheckpointError, match=message):
        ShardMap((4, 6), "float32", (replace(piece, **change),), ("dp",), ("dp", "tp"), (2, 2))  # type: ignore[arg-type]


def test_coordinates_need_a_mesh_and_old_maps_still_read() -> None:
    with pytest.raises(CheckpointError, match="names no mesh"):
        ShardMap((4,), "float32", (ShardPiece(0, (0,), (4,), coords=(0,)),))
    with pytest.raises(CheckpointError, match="not all in mesh_axes"):
        ShardMap((4,), "float32", (), ("ep",), ("dp",), (2,))
    old = {
        "global_shape": [4],
        "dtype": "float32",
        "pieces": [
            {
                "rank": 0,
                "box_offset": [0],
                "box_shape": [4],
                "flat_start": 0,
                "flat_stop": 4,
                "local_offset": 0,
            }
        ],
    }
    smap = ShardMap.from_json(old)
    assert smap.mesh_axes == () and smap.pieces[0].coords == ()
    with pytest.raises(CheckpointError, match="names no mesh"):
        smap.global_rank(smap.pieces[0])
