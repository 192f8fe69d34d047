"""What each rank writes, and how rank 0 merges every rank's report into the metadata.

A replicated block is written once: among the holders of pieces with the same box and flat
range (replicas), the lowest rank writes it. Each rank writes the pieces it is the writer of,
back to back, as one flat entry per tensor, so padding and replicas never reach the disk; the
*saved* map is the writers' pieces with their offsets into those entries. A plain tensor is
written by rank 0 and saved as a one-piece map. Rank 0 merges the pieces every rank reports
and checks that together they cover every tensor exactly once.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from deepshard.checkpoint._types import ShardedTensor
from deepshard.interface import ShardMap, ShardPiece
from deepshard.interface.errors import CheckpointError

__all__ = ["RankPlan", "merge_reports", "plan_rank"]


@dataclass(frozen=True)
class RankPlan:
    """One rank's share of a save.

    Attributes:
        entries: ``(key, flat tensor)`` to write, in file order (views of the caller's storage
            where possible; copy them before returning to training when saving in background).
        pieces: For each key, the saved pieces as JSON (offsets into the written entry).
        shapes: For each key, ``(global_shape, dtype)``.
    """

    entries: list[tuple[str, torch.Tensor]]
    pieces: dict[str, list[dict[str, Any]]]
    shapes: dict[str, tuple[tuple[int, ...], str]]


def _geometry(piece: ShardPiece) -> tuple[object, ...]:
    return (piece.box_offset, piece.box_shape, piece.flat_start, piece.stop)


def _writers(smap: ShardMap) -> dict[tuple[object, ...], int]:
    writers: dict[tuple[object, ...], int] = {}
    for piece in smap.pieces:
        key = _geometry(piece)
        writers[key] = min(writers.get(key, piece.rank), *piece.holders)
    return writers


def _sharded_entry(
    value: ShardedTensor,
) -> tuple[torch.Tensor | None, list[dict[str, Any]]]:
    smap = value.shard_map
    writers = _writers(smap)
    flat = value.local.reshape(-1)
    parts, saved, cursor = [], [], 0
    for piece in smap.pieces_of(value.rank):
        if not piece.numel or writers[_geometry(piece)] != value.rank:
            continue
        parts.append(flat[piece.local_offset : piece.local_offset + piece.numel])
        plain = ShardPiece(
            value.rank,
            piece.box_offset,
            piece.box_shape,
            piece.flat_start,
            piece.stop,
            cursor,
            scale=piece.scale,
        )
        saved.append(plain.to_json())
        cursor += piece.numel
    if not parts:
        return None, []
    data = parts[0] if len(parts) == 1 and parts[0].is_contiguous() else torch.cat(parts)
    return data, saved


def plan_rank(items: Sequence[tuple[str, torch.Tensor | ShardedTensor]], rank: int) -> RankPlan:
    """What ``rank`` writes for the state's ``items``."""
    entries: list[tuple[str, torch.Tensor]] = []
    pieces: dict[str, list[dict[str, Any]]] = {}
    shapes: dict[str, tuple[tuple[int, ...], str]] = {}
    for name, value in items:
        if isinstance(value, ShardedTensor):
            smap = value.shard_map
            shapes[name] = (smap.global_shape, smap.dtype)
            data, saved = _sharded_entry(value)
        else:
            shape = tuple(value.shape)
            shapes[name] = (shape, str(value.dtype).removeprefix("torch."))
            data, saved = None, []
            if rank == 0:
                data = value.detach().reshape(-1)
                zero = tuple(0 for _ in shape)
                saved = [ShardPiece(0, zero, shape).to_json()]
        if data is not None:
            entries.append((name, data.detach()))
            pieces[name] = saved
    return RankPlan(entries, pieces, shapes)


def merge_reports(reports: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """The metadata ``tensors`` section from every rank's report; checks shapes and coverage.

    Each report has ``rank``, ``entry_file`` (the data file of each entry it wrote),
    ``shapes`` and ``pieces`` (as `RankPlan`, JSON).
    """
    shapes: dict[str, tuple[list[int], str]] = {}
    pieces: dict[str, list[ShardPiece]] = {}
    files: dict[str, dict[str, str]] = {}
    for report in reports:
        for name, (shape, dtype) in report["shapes"].items():
            known = shapes.setdefault(name, (list(shape), dtype))
            if known != (list(shape), dtype):
                raise CheckpointError(
                    f"{name}: rank {report['rank']} saves it as {dtype} {tuple(shape)}, another "
                    f"rank as {known[1]} {tuple(known[0])}; every rank must describe the same "
                    "global tensor"
                )
        for name, saved in report["pieces"].items():
            pieces.setdefault(name, []).extend(ShardPiece.from_json(p) for p in saved)
            files.setdefault(name, {})[str(report["rank"])] = report["entry_file"][name]
    tensors: dict[str, dict[str, Any]] = {}
    for name, (shape, dtype) in sorted(shapes.items()):
        smap = ShardMap(tuple(shape), dtype, tuple(pieces.get(name, ())))
        try:
            smap.validate_coverage()
        except CheckpointError as exc:
            raise CheckpointError(
                f"{name}: the ranks' shards do not cover the tensor once ({exc}); pass every "
                "rank's ShardedTensor with one shard map for the whole group"
            ) from exc
        tensors[name] = {"shard_map": smap.to_json(), "files": files.get(name, {})}
    return tensors
