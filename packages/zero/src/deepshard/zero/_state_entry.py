"""One ZeRO state shard (`StateShard`) and the arithmetic shared by the modules building them.

`deepshard.zero._state_shards` explains what the entries are; here are the entry itself and
the helpers every kind of entry uses: rebasing a parameter's map so each rank's pieces start at
local offset 0 of its own tensor, a replicated map for scalars, joining a rank's parts into one
local tensor (a view when there is one part) and the writer that copies a loaded tensor back.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch

from deepshard.interface import ShardMap, ShardPiece
from deepshard.interface.errors import CheckpointError

__all__ = ["StateShard", "Writer", "dtype_name", "joined", "rebased", "replicated", "splitter"]

Writer = Callable[[torch.Tensor], None]


@dataclass(frozen=True)
class StateShard:
    """One tensor of a ZeRO optimizer on this rank.

    Attributes:
        name: The parameter's fully qualified name (``param_groups.<g>`` for scalar state).
        kind: ``param``, ``master`` or the inner optimizer's state key (``exp_avg``, ``step``).
        shard_map: Where every element lives over the data-parallel group; each rank's pieces
            start at local offset 0 of its local tensor, back to back.
        tensor: This rank's elements, 1-D (0-d for scalars); a view of live storage where they
            are contiguous in one tensor, else a copy.
        frozen: The parameter is not trained (stage 3 keeps frozen parameters partitioned).
    """

    name: str
    kind: str
    shard_map: ShardMap
    tensor: torch.Tensor
    frozen: bool = False

    @property
    def key(self) -> str:
        """``<name>/<kind>``: the entry's key in a checkpoint."""
        return f"{self.name}/{self.kind}"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def rebased(smap: ShardMap, dtype: torch.dtype) -> ShardMap:
    """``smap`` in ``dtype`` with every rank's pieces back to back from local offset 0."""
    fill: dict[int, int] = {}
    pieces = []
    for piece in sorted(smap.pieces, key=lambda p: (p.rank, p.local_offset)):
        pieces.append(replace(piece, local_offset=fill.get(piece.rank, 0)))
        fill[piece.rank] = fill.get(piece.rank, 0) + piece.numel
    return replace(smap, dtype=dtype_name(dtype), pieces=tuple(pieces))


def replicated(like: Sequence[ShardMap], dtype: torch.dtype, ranks: int) -> ShardMap:
    """A 0-d tensor every rank of the group holds, on the same mesh as the maps ``like``."""
    coords = {p.rank: p.coords for smap in like for p in smap.pieces}
    mesh = like[0] if like else None
    pieces = tuple(ShardPiece(r, (), (), coords=coords.get(r, ())) for r in range(ranks))
    if mesh is None or any(not p.coords for p in pieces):
        return ShardMap((), dtype_name(dtype), tuple(ShardPiece(r, (), ()) for r in range(ranks)))
    return ShardMap((), dtype_name(dtype), pieces, mesh.axes, mesh.mesh_axes, mesh.mesh_shape)


def joined(parts: Sequence[torch.Tensor], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if len(parts) == 1:
        return parts[0]
    if not parts:
        return torch.empty(0, dtype=dtype, device=device)
    return torch.cat(list(parts))


def splitter(parts: Sequence[torch.Tensor]) -> Writer:
    """Copies a loaded local tensor into ``parts`` (no copy when it is the one live part)."""

    def write(value: torch.Tensor) -> None:
        flat = value.reshape(-1)
        if sum(p.numel() for p in parts) != flat.numel():
            raise CheckpointError(
                f"a loaded ZeRO state shard has {flat.numel()} elements where this rank holds "
                f"{sum(p.numel() for p in parts)}; load with the shard maps of state_shards()"
            )
        start = 0
        with torch.no_grad():
            for part in parts:
                source = flat[start : start + part.numel()]
                if source.data_ptr() != part.data_ptr() or source.device != part.device:
                    part.copy_(source)
                start += part.numel()

    return write
