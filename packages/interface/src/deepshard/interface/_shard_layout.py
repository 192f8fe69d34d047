"""Arithmetic on shard maps: contiguous runs, coverage, extract and rebuild, and constructors.

A piece is a box of the global tensor and a row-major flat range of that box. Its elements
fall into *runs*: stretches contiguous both in the global tensor and in the holder's local
storage. Inside a box, once every dimension after some dimension ``k`` is whole, one index of
the dimensions before ``k`` selects ``prod(box_shape[k:])`` consecutive global elements; the
flat range then clips the first and last of those stretches. Everything here works on runs,
so a check or a copy costs one step per run rather than one per element, and the checkpoint
package copies tensors run by run with the same arithmetic.

``extract`` and ``rebuild`` take flat Python sequences (this package never imports torch); they
are the reference the checkpoint package's tensor copies are tested against.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from deepshard.interface.errors import CheckpointError

if TYPE_CHECKING:
    from deepshard.interface.shard_map import ShardMap, ShardPiece

__all__ = [
    "contiguous_split",
    "extract",
    "flat_buffer",
    "piece_runs",
    "rebuild",
    "sub_parameter",
    "validate_coverage",
]

Run = tuple[int, int, int]
"""``(global_flat_start, local_flat_start, length)``."""


def _strides(shape: Sequence[int]) -> list[int]:
    return [math.prod(shape[d + 1 :]) for d in range(len(shape))]


def piece_runs(piece: ShardPiece, global_shape: Sequence[int]) -> list[Run]:
    """The contiguous runs of ``piece`` in a tensor of ``global_shape``, in local order."""
    if piece.numel == 0:
        return []
    ndim = len(global_shape)
    if ndim == 0:
        return [(0, piece.local_offset, 1)]
    k = ndim - 1
    while k > 0 and piece.box_shape[k] == global_shape[k]:
        k -= 1
    inner = math.prod(piece.box_shape[k:])
    outer_shape = piece.box_shape[:k]
    strides = _strides(global_shape)
    runs: list[Run] = []
    for outer in range(piece.flat_start // inner, (piece.stop - 1) // inner + 1):
        base = piece.box_offset[k] * strides[k]
        rest = outer
        for d in reversed(range(k)):
            rest, index = divmod(rest, outer_shape[d])
            base += (piece.box_offset[d] + index) * strides[d]
        lo = max(piece.flat_start, outer * inner)
        hi = min(piece.stop, (outer + 1) * inner)
        runs.append(
            (base + lo - outer * inner, piece.local_offset + lo - piece.flat_start, hi - lo)
        )
    return runs


def _geometry(piece: ShardPiece) -> tuple[object, ...]:
    return (piece.box_offset, piece.box_shape, piece.flat_start, piece.stop)


def _replica_groups(smap: ShardMap) -> list[list[ShardPiece]]:
    """Pieces grouped by geometry: each group is one block of the tensor and its holders."""
    groups: dict[tuple[object, ...], list[ShardPiece]] = {}
    for piece in smap.pieces:
        if piece.numel:
            groups.setdefault(_geometry(piece), []).append(piece)
    for pieces in groups.values():
        scales = {p.scale for p in pieces}
        if len(scales) > 1:
            holders = [h for p in pieces for h in p.holders]
            raise CheckpointError(
                f"replicas on ranks {holders} of one block (box offset {pieces[0].box_offset}, "
                f"flat range [{pieces[0].flat_start}, {pieces[0].stop})) carry different scales "
                f"{sorted(scales)}; every holder of a replicated block must store it alike"
            )
    return list(groups.values())


def _holders(pieces: Sequence[ShardPiece]) -> list[tuple[int, ShardPiece]]:
    return [(holder, piece) for piece in pieces for holder in piece.holders]


def validate_coverage(smap: ShardMap, data: Mapping[int, Sequence[float]] | None = None) -> None:
    """Raise `CheckpointError` unless every element is held exactly once, up to replicas."""
    groups = _replica_groups(smap)
    runs = sorted(
        (start, length, pieces[0].rank)
        for pieces in groups
        for start, _, length in piece_runs(pieces[0], smap.global_shape)
    )
    cursor, previous = 0, None
    for start, length, rank in runs:
        if start < cursor:
            raise CheckpointError(
                f"shard pieces of ranks {previous} and {rank} overlap at global element {start} "
                f"of a {smap.global_shape} tensor without being replicas; each element must "
                "have one block (replicas repeat the same box and flat range)"
            )
        if start > cursor:
            raise CheckpointError(_gap_message(smap, cursor))
        cursor, previous = start + length, rank
    if cursor != smap.numel:
        raise CheckpointError(_gap_message(smap, cursor))
    if data is not None:
        for pieces in groups:
            _check_replicas_agree(smap, pieces, data)


def _gap_message(smap: ShardMap, element: int) -> str:
    return (
        f"no rank holds global element {element} of a {smap.global_shape} tensor "
        f"({smap.missing_elements()} of {smap.numel} missing); the map must cover the tensor"
    )


def _local(data: Mapping[int, Sequence[float]], rank: int, piece: ShardPiece) -> Sequence[float]:
    if rank not in data:
        raise CheckpointError(f"no local storage given for rank {rank}, which holds a shard")
    values = data[rank][piece.local_offset : piece.local_offset + piece.numel]
    if len(values) != piece.numel:
        raise CheckpointError(
            f"rank {rank}'s local storage has {len(data[rank])} elements, too few for its piece "
            f"at local offset {piece.local_offset} of {piece.numel} elements"
        )
    return values


def _check_replicas_agree(
    smap: ShardMap, pieces: Sequence[ShardPiece], data: Mapping[int, Sequence[float]]
) -> None:
    holders = [(rank, piece) for rank, piece in _holders(pieces) if rank in data]
    if not holders:
        ranks = [rank for rank, _ in _holders(pieces)]
        raise CheckpointError(f"no local storage given for any of ranks {ranks} holding a block")
    first_rank, first_piece = holders[0]
    reference = list(_local(data, first_rank, first_piece))
    for rank, piece in holders[1:]:
        if list(_local(data, rank, piece)) != reference:
            raise CheckpointError(
                f"replicas on ranks {first_rank} and {rank} of a {smap.global_shape} tensor hold "
                f"different values for the block at box offset {piece.box_offset}; replicated "
                "state must be identical on every holder (resynchronise it before saving)"
            )


def _refuse_scaled(smap: ShardMap, linear: bool) -> None:
    scaled = sorted({p.scale for p in smap.pieces if p.scale != 1.0})
    if not linear and scaled:
        raise CheckpointError(
            f"moving optimizer state through a piece scaled by {scaled} is not supported: "
            "moments do not scale with the parameter (and eps not at all), so resuming would "
            "follow another trajectory; save the parameter unscaled or drop the optimizer state"
        )


def extract(
    smap: ShardMap, full: Sequence[float], rank: int, *, linear: bool = True
) -> list[float]:
    """``rank``'s flat local storage cut from the row-major ``full`` tensor (see ShardMap)."""
    _refuse_scaled(smap, linear)
    if len(full) != smap.numel:
        raise CheckpointError(
            f"the full tensor has {len(full)} elements, the map's {smap.global_shape} has "
            f"{smap.numel}"
        )
    pieces = smap.pieces_of(rank)
    out = [0.0] * max((p.local_offset + p.numel for p in pieces), default=0)
    for piece in pieces:
        for start, local, length in piece_runs(piece, smap.global_shape):
            out[local : local + length] = [v * piece.scale for v in full[start : start + length]]
    return out


def rebuild(
    smap: ShardMap, shards: Mapping[int, Sequence[float]], *, linear: bool = True
) -> list[float]:
    """The row-major full tensor from each rank's flat local storage; checks coverage first."""
    _refuse_scaled(smap, linear)
    validate_coverage(smap, shards)
    out = [0.0] * smap.numel
    for pieces in _replica_groups(smap):
        rank, piece = next((r, p) for r, p in _holders(pieces) if r in shards)
        values = shards[rank]
        for start, local, length in piece_runs(piece, smap.global_shape):
            out[start : start + length] = [v / piece.scale for v in values[local : local + length]]
    return out


def _check_dim(shape: tuple[int, ...], dim: int) -> int:
    if not -len(shape) <= dim < len(shape):
        raise CheckpointError(f"dim {dim} is out of range for a tensor of shape {shape}")
    return dim % len(shape)


def _check_sizes(name: str, sizes: Sequence[int], total: int, what: str) -> None:
    if any(isinstance(s, bool) or not isinstance(s, int) or s < 0 for s in sizes):
        raise CheckpointError(f"{name} must be non-negative ints, got {list(sizes)}")
    if sum(sizes) != total:
        raise CheckpointError(f"{name} {list(sizes)} sum to {sum(sizes)}, not {what} {total}")


def contiguous_split(
    global_shape: Sequence[int], dtype: str, *, dim: int, sizes: Sequence[int]
) -> ShardMap:
    """Rank ``r`` holds the ``sizes[r]`` slices along ``dim`` after those of lower ranks."""
    from deepshard.interface.shard_map import ShardMap, ShardPiece

    shape = tuple(global_shape)
    dim = _check_dim(shape, dim)
    _check_sizes("sizes", sizes, shape[dim], f"the size of dim {dim}:")
    pieces, start = [], 0
    for rank, size in enumerate(sizes):
        offset = tuple(start if d == dim else 0 for d in range(len(shape)))
        box = tuple(size if d == dim else shape[d] for d in range(len(shape)))
        pieces.append(ShardPiece(rank, offset, box))
        start += size
    return ShardMap(shape, dtype, tuple(pieces))


def _balanced(total: int, world_size: int) -> list[int]:
    base, extra = divmod(total, world_size)
    return [base + (1 if r < extra else 0) for r in range(world_size)]


def sub_parameter(
    global_shape: Sequence[int], dtype: str, *, dim: int, parts: Sequence[int], world_size: int
) -> ShardMap:
    """A fused parameter whose ``parts`` along ``dim`` (Q, K, V) are each split over the ranks.

    Rank ``r`` stores its slice of every part back to back (its local tensor is the
    concatenation along ``dim``); a part that does not divide gives its first ranks one more.
    """
    from deepshard.interface.shard_map import ShardMap, ShardPiece

    shape = tuple(global_shape)
    dim = _check_dim(shape, dim)
    _check_sizes("parts", parts, shape[dim], f"the size of dim {dim}:")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise CheckpointError(f"world_size must be an int >= 1, got {world_size!r}")
    if math.prod(shape[:dim]) != 1:
        raise CheckpointError(
            f"a sub-parameter split along dim {dim} of {shape} interleaves the parts in each "
            "rank's storage, which one box and flat range per piece cannot describe; split "
            "along dim 0 (a Linear's output features) or store each part as its own tensor"
        )
    row = math.prod(shape[dim + 1 :])
    pieces, locals_ = [], [0] * world_size
    part_start = 0
    for part in parts:
        start = part_start
        for rank, size in enumerate(_balanced(part, world_size)):
            offset = tuple(start if d == dim else 0 for d in range(len(shape)))
            box = tuple(size if d == dim else shape[d] for d in range(len(shape)))
            pieces.append(ShardPiece(rank, offset, box, local_offset=locals_[rank]))
            locals_[rank] += size * row
            start += size
        part_start += part
    return ShardMap(shape, dtype, tuple(pieces))


def flat_buffer(
    shapes: Sequence[Sequence[int]], dtype: str, *, world_size: int, alignment: int = 1
) -> list[ShardMap]:
    """ZeRO's layout of several tensors flattened into one buffer cut into equal partitions.

    Each tensor starts at a multiple of ``alignment`` elements; the buffer is padded to
    ``world_size`` equal partitions, and rank ``r`` keeps partition ``r``, so a partition
    boundary may fall inside a tensor (its tail on one rank, its head on the next).
    ``local_offset`` is where a piece starts inside its holder's partition.
    """
    from deepshard.interface.shard_map import ShardMap, ShardPiece

    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise CheckpointError(f"world_size must be an int >= 1, got {world_size!r}")
    if alignment < 1:
        raise CheckpointError(f"alignment must be >= 1 element, got {alignment}")
    starts, cursor = [], 0
    for shape in shapes:
        starts.append(cursor)
        cursor += -(-math.prod(shape) // alignment) * alignment
    partition = -(-cursor // world_size)
    maps = []
    for shape, begin in zip(shapes, starts, strict=True):
        full, end = tuple(shape), begin + math.prod(shape)
        zero = tuple(0 for _ in full)
        pieces = []
        for rank in range(world_size):
            lo, hi = max(begin, rank * partition), min(end, (rank + 1) * partition)
            if lo < hi:
                local = lo - rank * partition
                pieces.append(ShardPiece(rank, zero, full, lo - begin, hi - begin, local))
        maps.append(ShardMap(full, dtype, tuple(pieces)))
    return maps
