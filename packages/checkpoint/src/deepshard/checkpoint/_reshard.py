"""Filling a rank's shards from a checkpoint saved with any layout, reading only what it needs.

Both layouts are shard maps of the same global tensor. Each piece is a list of contiguous runs
(``ShardMap.runs``: global start, local start, length); the saved runs never overlap (the save
checked coverage), so for every run of the target piece a binary search finds the saved runs
it intersects, and each intersection is one copy: a range of a saved rank's flat entry into a
range of the target's local storage. Copies from one saved entry are read with one
``get_slice`` over their bounding range when that range is mostly needed, else one slice each,
so a rank reads about the bytes it keeps. A target piece scaled differently from the saved one
is multiplied by ``target_scale / saved_scale``.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass

import torch

from deepshard.interface import ShardMap
from deepshard.interface.errors import CheckpointError

__all__ = ["Copy", "apply_copies", "plan_copies", "source_ranges"]


@dataclass(frozen=True)
class Copy:
    """One contiguous copy from a saved entry into the target's local storage.

    Attributes:
        saved_rank: The rank whose entry holds the source.
        source: Start in that rank's flat entry.
        dest: Start in the target's flat local storage.
        length: Number of elements.
        factor: Multiplier turning the saved values into the target's (scales).
    """

    saved_rank: int
    source: int
    dest: int
    length: int
    factor: float


def plan_copies(
    name: str, saved: ShardMap, target: ShardMap, rank: int, linear: bool
) -> list[Copy]:
    """The copies that fill ``rank``'s pieces of ``target`` from the ``saved`` layout."""
    if saved.global_shape != target.global_shape:
        raise CheckpointError(
            f"{name}: the checkpoint holds shape {saved.global_shape}, the model wants "
            f"{target.global_shape}; load a checkpoint of the same model (or strict=False and "
            "leave it out of `like`)"
        )
    source_runs = sorted(
        (start, local, length, piece.rank, piece.scale)
        for piece in saved.pieces
        for start, local, length in saved.runs(piece)
    )
    starts = [run[0] for run in source_runs]
    copies: list[Copy] = []
    for piece in target.pieces_of(rank):
        for start, local, length in target.runs(piece):
            i = max(bisect.bisect_right(starts, start) - 1, 0)
            while i < len(source_runs) and source_runs[i][0] < start + length:
                s_start, s_local, s_len, s_rank, s_scale = source_runs[i]
                lo, hi = max(start, s_start), min(start + length, s_start + s_len)
                if lo < hi:
                    factor = piece.scale / s_scale
                    if factor != 1.0 and not linear:
                        raise CheckpointError(
                            f"{name}: optimizer state saved with scale {s_scale} cannot be loaded "
                            f"into a piece scaled by {piece.scale}: moments do not scale with the "
                            "parameter; load it unscaled or drop the optimizer state"
                        )
                    copies.append(
                        Copy(s_rank, s_local + lo - s_start, local + lo - start, hi - lo, factor)
                    )
                i += 1
    return copies


def _index(starts: list[int], lengths: list[int]) -> torch.Tensor:
    """``cat(arange(s, s + n) for s, n)`` without a Python loop over elements."""
    lengths_t = torch.tensor(lengths, dtype=torch.int64)
    offsets = torch.cumsum(lengths_t, 0) - lengths_t
    shift = torch.repeat_interleave(torch.tensor(starts, dtype=torch.int64) - offsets, lengths_t)
    return shift + torch.arange(int(lengths_t.sum()), dtype=torch.int64)


def source_ranges(copies: list[Copy]) -> dict[int, tuple[int, int]]:
    """For each saved rank, the ``[lo, hi)`` element range of its entry the copies touch."""
    ranges: dict[int, tuple[int, int]] = {}
    for c in copies:
        lo, hi = ranges.get(c.saved_rank, (c.source, c.source + c.length))
        ranges[c.saved_rank] = (min(lo, c.source), max(hi, c.source + c.length))
    return ranges


def apply_copies(
    dest: torch.Tensor, copies: list[Copy], read: Callable[[int, int, int], torch.Tensor]
) -> int:
    """Perform ``copies`` into the flat ``dest``; ``read(rank, start, stop)`` reads a saved range.

    Returns:
        The number of elements read from the checkpoint.
    """
    read_elements = 0
    by_source: dict[tuple[int, float], list[Copy]] = {}
    for copy in copies:
        by_source.setdefault((copy.saved_rank, copy.factor), []).append(copy)
    for (saved_rank, factor), group in by_source.items():
        lo = min(c.source for c in group)
        hi = max(c.source + c.length for c in group)
        needed = sum(c.length for c in group)
        if hi - lo <= 2 * needed:
            chunks = [(lo, read(saved_rank, lo, hi).to(dest.device), group)]
        else:
            chunks = [
                (c.source, read(saved_rank, c.source, c.source + c.length).to(dest.device), [c])
                for c in group
            ]
        for base, data, members in chunks:
            read_elements += data.numel()
            if factor != 1.0:
                data = data.to(dest.dtype) * factor
            if len(members) == 1:
                c = members[0]
                dest[c.dest : c.dest + c.length].copy_(
                    data[c.source - base : c.source - base + c.length]
                )
                continue
            src_idx = _index([c.source - base for c in members], [c.length for c in members])
            dst_idx = _index([c.dest for c in members], [c.length for c in members])
            dest[dst_idx.to(dest.device)] = data[src_idx.to(data.device)].to(dest.dtype)
    return read_elements
