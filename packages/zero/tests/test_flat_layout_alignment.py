"""The flat layout: 16-byte alignment, recorded padding, buckets, and partitions that cover every
element exactly once; shard maps consistent with it, including straddling and empty parameters.

Everything is checked element by element against an independent walk of the buffer, not against
the layout's own arithmetic.
"""

from __future__ import annotations

from math import prod

import pytest

from deepshard.interface import ShardMap, ShardPiece
from deepshard.interface.errors import ConfigError
from deepshard.zero import ALIGNMENT_BYTES, FlatLayout, plan_flat_layout

# The test MLP's parameters (13→37→29→7) plus an empty one and a scalar.
SHAPES = [(37, 13), (37,), (0, 5), (29, 37), (29,), (), (7, 29), (7,)]
ELEMENT_SIZES = {"fp32": 4, "bf16": 2, "fp16": 2}


def _layouts() -> list[tuple[str, int, int, FlatLayout]]:
    out = []
    for name, size in ELEMENT_SIZES.items():
        for world in (1, 2, 3, 4):
            for bucket in (1, 500, 10**9):
                layout = plan_flat_layout(
                    SHAPES, element_size=size, world_size=world, bucket_numel=bucket
                )
                out.append((name, size, world, layout))
    return out


@pytest.mark.parametrize(("name", "size", "world", "layout"), _layouts())
def test_parameters_buckets_and_chunks_start_16_byte_aligned(
    name: str, size: int, world: int, layout: FlatLayout
) -> None:
    assert layout.alignment * size == ALIGNMENT_BYTES
    for slot in layout.slots:
        assert slot.offset * size % ALIGNMENT_BYTES == 0, (name, slot)
    for bucket in layout.buckets:
        assert bucket.start * size % ALIGNMENT_BYTES == 0
        assert bucket.local_start * size % ALIGNMENT_BYTES == 0
        for rank in range(world):
            assert layout.chunk_start(bucket, rank) * size % ALIGNMENT_BYTES == 0
        assert bucket.numel % world == 0


@pytest.mark.parametrize(("name", "size", "world", "layout"), _layouts())
def test_padding_is_recorded_and_parameters_do_not_overlap(
    name: str, size: int, world: int, layout: FlatLayout
) -> None:
    owner = [None] * layout.numel
    for slot in layout.slots:
        for i in range(slot.offset, slot.stop):
            assert owner[i] is None, f"element {i} belongs to two parameters"
            owner[i] = slot.index
    assert owner.count(None) == layout.padding
    assert layout.padding == layout.numel - sum(prod(s) for s in SHAPES)
    assert [slot.index for slot in layout.slots] == list(range(len(SHAPES)))
    assert [slot.shape for slot in layout.slots] == SHAPES
    # buckets tile the buffer in order and hold whole parameters
    assert sum(b.numel for b in layout.buckets) == layout.numel
    for bucket in layout.buckets:
        for index in bucket.slots:
            slot = layout.slots[index]
            assert bucket.start <= slot.offset <= slot.stop <= bucket.stop
        assert bucket.members == tuple(i for i in bucket.slots if prod(SHAPES[i]) > 0)


def test_buckets_respect_the_size_limit_unless_one_parameter_is_bigger() -> None:
    layout = plan_flat_layout(SHAPES, element_size=4, world_size=2, bucket_numel=500)
    for bucket in layout.buckets:
        used = max(layout.slots[i].stop for i in bucket.slots) - bucket.start
        big = [i for i in bucket.slots if prod(SHAPES[i]) > 500]
        assert used <= 500 or (big and len(bucket.members) == 1)
    # the 1073-element weight is alone in its bucket
    weight = layout.slots[3]
    assert layout.buckets[weight.bucket].members == (3,)
    one = plan_flat_layout(SHAPES, element_size=4, world_size=2, bucket_numel=10**9)
    assert len(one.buckets) == 1


@pytest.mark.parametrize(("name", "size", "world", "layout"), _layouts())
def test_partitions_cover_every_element_exactly_once(
    name: str, size: int, world: int, layout: FlatLayout
) -> None:
    # Walk each rank's partition through its chunks: every flat element is held once.
    held = [0] * layout.numel
    for rank in range(world):
        local = 0
        for bucket in layout.buckets:
            assert bucket.local_start == local
            start = layout.chunk_start(bucket, rank)
            for i in range(start, start + layout.chunk_numel(bucket)):
                held[i] += 1
            local += layout.chunk_numel(bucket)
        assert local == layout.partition_numel
    assert held == [1] * layout.numel
    assert layout.partition_numel * world == layout.numel


def _flat_position(layout: FlatLayout, rank: int, local: int) -> int:
    """Where local element ``local`` of ``rank``'s partition sits in the flat buffer."""
    for bucket in layout.buckets:
        chunk = layout.chunk_numel(bucket)
        if bucket.local_start <= local < bucket.local_start + chunk:
            return layout.chunk_start(bucket, rank) + local - bucket.local_start
    raise AssertionError(f"local element {local} is outside rank {rank}'s partition")


@pytest.mark.parametrize(("name", "size", "world", "layout"), _layouts())
def test_pieces_map_each_parameter_element_to_its_partition_slot(
    name: str, size: int, world: int, layout: FlatLayout
) -> None:
    for slot in layout.slots:
        pieces = layout.pieces(slot)
        covered = [0] * slot.numel
        for piece in pieces:
            for k in range(piece.flat_stop - piece.flat_start):
                covered[piece.flat_start + k] += 1
                flat = _flat_position(layout, piece.rank, piece.local_offset + k)
                assert flat == slot.offset + piece.flat_start + k
        assert covered == [1] * slot.numel
        shard_map = ShardMap(
            slot.shape,
            "float32",
            tuple(
                ShardPiece(p.rank, (0,) * len(slot.shape), slot.shape, p.flat_start, p.flat_stop)
                for p in pieces
            ),
        )
        assert shard_map.missing_elements() == 0


def test_odd_parameters_straddle_partitions_and_empty_ones_hold_nothing() -> None:
    layout = plan_flat_layout(SHAPES, element_size=4, world_size=4, bucket_numel=10**9)
    straddling = [s for s in layout.slots if len(layout.pieces(s)) > 1]
    assert straddling, "with 4 ranks some parameter must be split between ranks"
    empty = layout.slots[2]
    assert empty.numel == 0 and layout.pieces(empty) == ()
    scalar = layout.slots[5]
    assert scalar.numel == 1 and len(layout.pieces(scalar)) == 1


def test_empty_group_and_bad_arguments() -> None:
    empty = plan_flat_layout([], element_size=2, world_size=4, bucket_numel=8)
    assert (empty.numel, empty.buckets, empty.partition_numel) == (0, (), 0)
    with pytest.raises(ConfigError, match="reduce_bucket_size"):
        plan_flat_layout(SHAPES, element_size=4, world_size=2, bucket_numel=0)
    with pytest.raises(ConfigError, match="16 bytes"):
        plan_flat_layout(SHAPES, element_size=3, world_size=2, bucket_numel=8)
