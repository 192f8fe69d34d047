"""Where every parameter lives in ZeRO's flat buffers and which rank owns which part.

The trainable parameters of one optimizer param group are laid out back to back in one flat
buffer, in the group's order. The buffer is cut into *buckets* of whole parameters, at most
``bucket_numel`` elements each (a parameter larger than that is a bucket of its own). Buckets are
the unit of communication: one collective reduces one bucket's gradients.

Buckets are also the unit of partitioning. Each bucket is padded to a multiple of
``world_size × alignment`` elements and split into ``world_size`` equal *chunks*; rank ``r``
owns chunk ``r`` of every bucket, and its flat partition is its chunks one after another. So a
bucket's reduce-scatter delivers exactly one contiguous range of every rank's partition, during
backward, without any copy, and the updated chunks all-gather straight back into the bucket.
A parameter may straddle chunks, i.e. be split over several ranks at arbitrary element
boundaries; `FlatLayout.pieces` says which part each rank holds and where in its partition.

Every parameter, bucket and chunk starts at a multiple of ``ALIGNMENT_BYTES`` (16) bytes of the
buffer: grouped-GEMM kernels and vectorised optimizer kernels need it. The alignment is counted
in elements of the model dtype; fp32 master partitions, which share the element offsets, are
then aligned too. The padding is recorded (`FlatLayout.padding`) and always zero-filled, so it
never changes a gradient norm.

With ``world_size == 1`` (ZeRO stage 0) buckets are only aligned, and the single "partition" is
the whole buffer. Everything here is arithmetic on integers, without torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from math import prod

from deepshard.interface.errors import ConfigError

__all__ = [
    "ALIGNMENT_BYTES",
    "Bucket",
    "FlatLayout",
    "GatherCall",
    "ParamSlot",
    "Piece",
    "gather_copies",
    "plan_flat_layout",
    "plan_gather_calls",
]

ALIGNMENT_BYTES = 16
"""Every parameter, bucket and chunk starts at a multiple of this many bytes."""


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


@dataclass(frozen=True)
class ParamSlot:
    """One parameter's place in the flat buffer.

    Attributes:
        index: Position among the group's trainable parameters.
        shape: The parameter's shape.
        offset: First element in the flat buffer (a multiple of the alignment).
        bucket: Index of the bucket holding it.
    """

    index: int
    shape: tuple[int, ...]
    offset: int
    bucket: int

    @property
    def numel(self) -> int:
        """Number of elements of the parameter."""
        return prod(self.shape)

    @property
    def stop(self) -> int:
        """One past the parameter's last element in the flat buffer."""
        return self.offset + self.numel


@dataclass(frozen=True)
class Bucket:
    """A run of whole parameters reduced by one collective and split into equal chunks.

    Attributes:
        index: Position in the group's buckets.
        start: First element in the flat buffer.
        numel: Padded size: a multiple of ``world_size × alignment``.
        local_start: Where every rank's chunk of this bucket starts in that rank's partition.
        slots: Indices of the parameters it holds.
        members: The subset of ``slots`` with at least one element (those that get gradients).
    """

    index: int
    start: int
    numel: int
    local_start: int
    slots: tuple[int, ...]
    members: tuple[int, ...]

    @property
    def stop(self) -> int:
        """One past the bucket's last element in the flat buffer."""
        return self.start + self.numel


@dataclass(frozen=True)
class Piece:
    """The part of one parameter that one rank's partition holds.

    Attributes:
        rank: The holder's index in the partition group.
        flat_start: First element of the parameter (row-major) held.
        flat_stop: One past the last element held.
        local_offset: Where the piece starts in the rank's flat partition.
    """

    rank: int
    flat_start: int
    flat_stop: int
    local_offset: int


@dataclass(frozen=True)
class GatherCall:
    """One all-gather of a range of every rank's partition.

    Attributes:
        local_start: First partition element every rank sends.
        local_stop: One past the last.
        bucket: The bucket whose whole chunk this call covers, when it covers exactly one; the
            gathered result then *is* that bucket, so it can be written in place.
    """

    local_start: int
    local_stop: int
    bucket: int | None

    @property
    def numel(self) -> int:
        """Elements each rank sends."""
        return self.local_stop - self.local_start


@dataclass(frozen=True)
class FlatLayout:
    """The flat buffer of one param group and its partitioning over ``world_size`` ranks.

    Build it with `plan_flat_layout`.

    Attributes:
        alignment: Alignment in elements (``ALIGNMENT_BYTES // element_size``).
        world_size: Number of partitions (1 for stage 0).
        slots: One per trainable parameter, in order.
        buckets: In buffer order.
        numel: Padded size of the whole buffer.
    """

    alignment: int
    world_size: int
    slots: tuple[ParamSlot, ...]
    buckets: tuple[Bucket, ...]
    numel: int

    @property
    def partition_numel(self) -> int:
        """Elements of every rank's partition (all chunks together)."""
        return self.numel // self.world_size

    @property
    def padding(self) -> int:
        """Elements of the buffer that belong to no parameter."""
        return self.numel - sum(slot.numel for slot in self.slots)

    def chunk_numel(self, bucket: Bucket) -> int:
        """Elements of each rank's chunk of ``bucket``."""
        return bucket.numel // self.world_size

    def chunk_start(self, bucket: Bucket, rank: int) -> int:
        """First flat-buffer element of rank ``rank``'s chunk of ``bucket``."""
        return bucket.start + rank * self.chunk_numel(bucket)

    def pieces(self, slot: ParamSlot) -> tuple[Piece, ...]:
        """Every rank's part of the parameter in ``slot``, in rank order (none if it is empty)."""
        bucket = self.buckets[slot.bucket]
        chunk = self.chunk_numel(bucket)
        pieces = []
        for rank in range(self.world_size):
            chunk_start = self.chunk_start(bucket, rank)
            lo = max(slot.offset, chunk_start)
            hi = min(slot.stop, chunk_start + chunk)
            if lo < hi:
                local = bucket.local_start + lo - chunk_start
                pieces.append(Piece(rank, lo - slot.offset, hi - slot.offset, local))
        return tuple(pieces)


def _alignment(element_size: int) -> int:
    if element_size < 1 or ALIGNMENT_BYTES % element_size:
        raise ConfigError(
            f"ZeRO flat buffers align parameters to {ALIGNMENT_BYTES} bytes, which needs an "
            f"element size dividing {ALIGNMENT_BYTES}; got {element_size} bytes"
        )
    return ALIGNMENT_BYTES // element_size


def _group_into_buckets(
    shapes: Sequence[tuple[int, ...]], alignment: int, bucket_numel: int
) -> list[list[tuple[int, int]]]:
    """Whole parameters per bucket as ``(index, offset in bucket)``, at most ``bucket_numel``."""
    buckets: list[list[tuple[int, int]]] = []
    fill = 0
    for index, shape in enumerate(shapes):
        numel = prod(shape)
        offset = _round_up(fill, alignment)
        if not buckets or (fill > 0 and offset + numel > bucket_numel):
            buckets.append([])
            offset = 0
        buckets[-1].append((index, offset))
        fill = offset + numel
    return buckets


def plan_flat_layout(
    shapes: Sequence[Sequence[int]], *, element_size: int, world_size: int, bucket_numel: int
) -> FlatLayout:
    """Lay out parameters of the given shapes in aligned, partitioned buckets.

    Args:
        shapes: The trainable parameters' shapes, in param-group order (empty ones allowed).
        element_size: Bytes per element of the model dtype.
        world_size: Ranks the buffer is partitioned over (1 for no partitioning).
        bucket_numel: Most elements per bucket (``reduce_bucket_size``); a bigger parameter
            gets a bucket of its own.

    Returns:
        The layout.

    Raises:
        ConfigError: A non-positive ``world_size`` or ``bucket_numel``, or an element size that
            cannot be aligned to 16 bytes.
    """
    if world_size < 1 or bucket_numel < 1:
        raise ConfigError(
            f"plan_flat_layout needs world_size >= 1 and bucket_numel "
            f"(zero_optimization.reduce_bucket_size) >= 1; got {world_size} and {bucket_numel}"
        )
    alignment = _alignment(element_size)
    sizes = [tuple(int(d) for d in s) for s in shapes]
    slots: list[ParamSlot] = []
    buckets: list[Bucket] = []
    start = local_start = 0
    for b, members in enumerate(_group_into_buckets(sizes, alignment, bucket_numel)):
        used = max(offset + prod(sizes[i]) for i, offset in members)
        numel = _round_up(used, world_size * alignment)
        slots.extend(ParamSlot(i, sizes[i], start + offset, b) for i, offset in members)
        indices = tuple(i for i, _ in members)
        nonempty = tuple(i for i in indices if prod(sizes[i]) > 0)
        buckets.append(Bucket(b, start, numel, local_start, indices, nonempty))
        start += numel
        local_start += numel // world_size
    return FlatLayout(alignment, world_size, tuple(slots), tuple(buckets), start)


def _gather_segments(layout: FlatLayout, limit: int) -> list[tuple[int, int, int | None]]:
    """Whole non-empty chunks as ``(start, stop, bucket)``; chunks over ``limit`` as slices."""
    segments: list[tuple[int, int, int | None]] = []
    for bucket in layout.buckets:
        lo, hi = bucket.local_start, bucket.local_start + layout.chunk_numel(bucket)
        if hi - lo > limit:
            segments.extend((s, min(s + limit, hi), None) for s in range(lo, hi, limit))
        elif hi > lo:
            segments.append((lo, hi, bucket.index))
    return segments


def plan_gather_calls(layout: FlatLayout, *, max_numel: int) -> tuple[GatherCall, ...]:
    """Cut every rank's partition into all-gather calls of at most ``max_numel`` gathered elements.

    Consecutive whole chunks share a call while they fit; a chunk larger than the limit is cut
    into aligned slices, one call each. Empty chunks are skipped, so every call moves data.

    Args:
        layout: The group's layout.
        max_numel: ``allgather_bucket_size``: most elements one call gathers (all ranks
            together). Values below ``world_size × alignment`` mean one aligned slice per call.

    Returns:
        The calls, in partition order; together they cover the partition exactly once.
    """
    per_rank = max(layout.alignment, max_numel // layout.world_size)
    limit = per_rank - per_rank % layout.alignment
    calls: list[GatherCall] = []
    for start, stop, bucket in _gather_segments(layout, limit):
        last = calls[-1] if calls else None
        mergeable = last is not None and bucket is not None and last.local_stop == start
        if mergeable and last is not None and stop - last.local_start <= limit:
            calls[-1] = GatherCall(last.local_start, stop, None)
        else:
            calls.append(GatherCall(start, stop, bucket))
    return tuple(calls)


def gather_copies(layout: FlatLayout, call: GatherCall) -> tuple[tuple[int, int, int], ...]:
    """Where the gathered elements of ``call`` go in the flat buffer.

    The gathered tensor holds every rank's ``[local_start, local_stop)`` back to back, in rank
    order. Local element ``x`` of rank ``r`` lies in the chunk of the bucket covering ``x``.

    Returns:
        ``(source offset in the gathered tensor, destination offset in the flat buffer,
        length)`` runs that together place every gathered element exactly once.
    """
    copies: list[tuple[int, int, int]] = []
    for rank in range(layout.world_size):
        base = rank * call.numel
        for bucket in layout.buckets:
            lo = max(call.local_start, bucket.local_start)
            hi = min(call.local_stop, bucket.local_start + layout.chunk_numel(bucket))
            if lo < hi:
                dst = layout.chunk_start(bucket, rank) + lo - bucket.local_start
                copies.append((base + lo - call.local_start, dst, hi - lo))
    return tuple(copies)
