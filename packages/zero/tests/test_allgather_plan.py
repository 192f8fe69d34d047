"""All-gather planning: calls respect ``allgather_bucket_size``, cover every partition once, and
their copy plans rebuild the flat buffer exactly (simulated with tensors, no processes)."""

from __future__ import annotations

import pytest
import torch

from deepshard.zero import FlatLayout, gather_copies, plan_flat_layout, plan_gather_calls

SHAPES = [(37, 13), (37,), (0, 5), (29, 37), (29,), (7, 29), (7,)]


def _partition(flat: torch.Tensor, layout: FlatLayout, rank: int) -> torch.Tensor:
    chunks = [
        flat[layout.chunk_start(b, rank) : layout.chunk_start(b, rank) + layout.chunk_numel(b)]
        for b in layout.buckets
    ]
    return torch.cat(chunks) if chunks else flat[:0]


def _simulate(layout: FlatLayout, max_numel: int) -> torch.Tensor:
    """Rebuild the flat buffer from every rank's partition the way `gather_from` does."""
    flat = torch.arange(layout.numel, dtype=torch.float64)
    partitions = [_partition(flat, layout, r) for r in range(layout.world_size)]
    rebuilt = torch.full_like(flat, -1.0)
    for call in plan_gather_calls(layout, max_numel=max_numel):
        gathered = torch.cat([p[call.local_start : call.local_stop] for p in partitions])
        if call.bucket is not None:
            bucket = layout.buckets[call.bucket]
            rebuilt[bucket.start : bucket.stop] = gathered
            continue
        for src, dst, length in gather_copies(layout, call):
            assert (rebuilt[dst : dst + length] == -1).all(), "an element is written twice"
            rebuilt[dst : dst + length] = gathered[src : src + length]
    return rebuilt


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("bucket_numel", [100, 600, 10**9])
@pytest.mark.parametrize("max_numel", [0, 64, 1000, 10**9])
def test_gathered_partitions_rebuild_the_buffer(
    world: int, bucket_numel: int, max_numel: int
) -> None:
    layout = plan_flat_layout(SHAPES, element_size=4, world_size=world, bucket_numel=bucket_numel)
    rebuilt = _simulate(layout, max_numel)
    assert torch.equal(rebuilt, torch.arange(layout.numel, dtype=torch.float64))


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("max_numel", [0, 64, 1000, 10**9])
def test_calls_cover_the_partition_once_within_the_limit(world: int, max_numel: int) -> None:
    layout = plan_flat_layout(SHAPES, element_size=2, world_size=world, bucket_numel=600)
    calls = plan_gather_calls(layout, max_numel=max_numel)
    position = 0
    for call in calls:
        assert call.local_start == position and call.numel > 0
        assert call.local_start % layout.alignment == 0
        # gathered elements (all ranks) stay within the limit, except the minimal aligned slice
        assert world * call.numel <= max(max_numel, world * layout.alignment)
        position = call.local_stop
        if call.bucket is not None:  # a direct call is exactly one bucket's chunk
            bucket = layout.buckets[call.bucket]
            assert call.local_start == bucket.local_start
            assert call.numel == layout.chunk_numel(bucket)
    assert position == layout.partition_numel


def test_default_sizes_gather_each_bucket_in_place() -> None:
    layout = plan_flat_layout(SHAPES, element_size=4, world_size=2, bucket_numel=10**9)
    calls = plan_gather_calls(layout, max_numel=500_000_000)
    assert [call.bucket for call in calls] == [0]
