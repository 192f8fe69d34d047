"""Shard maps: where every element of a sharded tensor lives.

Every package that shards a tensor (ZeRO partitions, tensor-parallel slices, expert shards,
sequence-parallel splits) describes the result with a `ShardMap`, and the checkpoint
package reads nothing else to save, load and reshard it.

A shard is an affine map from a rank's local storage to the global tensor, in two steps:

1. a *box* of the global tensor: ``box_offset`` (per dimension) and ``box_shape``. Tensor
   parallelism cuts boxes (rows or columns of a weight).
2. a *flat range* ``[flat_start, flat_stop)`` of that box, counted in row-major order. ZeRO
   flattens parameters into one buffer and cuts it at arbitrary element boundaries, so a rank may
   hold the tail of one row and the head of the next; the whole box is ``[0, numel(box))``.

Local element ``i`` of a piece is therefore global element
``box_offset + unravel(flat_start + i, box_shape)``. TP slicing followed by ZeRO partitioning of
the slice is one piece of each kind composed, and replication is several ranks holding equal
pieces. The map is plain data (JSON in checkpoints, no pickles) and never imports torch.

A map may also name the whole mesh (``mesh_axes``, ``mesh_shape``); every piece then carries
its holder's coordinate on each mesh axis (``coords``), so the maps written by ranks in different
tensor-, expert- or pipeline-parallel positions can be merged without knowing how their groups
were built. ``rank`` stays the holder's index in the group spread over ``axes`` (row-major over
those axes' coordinates, which the map checks). Maps without a mesh are read as before.

A piece may name further holders (``replicas``: ranks keeping an identical copy at the same
local offset) and a ``scale``: the rank stores ``full * scale`` (a row-parallel layer keeps its
bias divided by the TP degree on every rank, so that summing the partial outputs adds it once).
Rebuilding divides the scale out. Optimizer moments do not scale linearly with the parameter
(Adam's second moment goes with the square of the gradient, and its ``eps`` does not scale at
all), so moving them through a scaled piece is refused. Coverage checks, ``extract``,
``rebuild`` and the layout constructors live in `deepshard.interface._shard_layout`.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from deepshard.interface import _shard_layout
from deepshard.interface.errors import CheckpointError

__all__ = ["SHARD_MAP_FORMAT_VERSION", "ShardMap", "ShardPiece"]

SHARD_MAP_FORMAT_VERSION = 2
"""Version of `ShardMap.to_json`; 1 (no ``format_version`` key) had no scales or replicas."""


def _numel(shape: Sequence[int]) -> int:
    return math.prod(shape)


@dataclass(frozen=True)
class ShardPiece:
    """The part of a global tensor that one rank stores.

    Attributes:
        rank: The holder's rank in the process group the map refers to.
        box_offset: Start of the box in every dimension of the global tensor.
        box_shape: Extent of the box in every dimension.
        flat_start: First element of the box (row-major) that the rank stores.
        flat_stop: One past the last stored element; ``None`` means the end of the box.
        local_offset: Where the piece starts in the rank's local flat storage (ZeRO buffers hold
            several parameters back to back, each 16-byte aligned).
        coords: The holder's coordinate on every axis of the map's ``mesh_axes`` (empty when the
            map names no mesh).
        scale: The holder stores ``full * scale`` (1.0 for an unscaled piece; never 0).
        replicas: Further ranks that store an identical copy at the same ``local_offset``.
    """

    rank: int
    box_offset: tuple[int, ...]
    box_shape: tuple[int, ...]
    flat_start: int = 0
    flat_stop: int | None = None
    local_offset: int = 0
    coords: tuple[int, ...] = ()
    scale: float = 1.0
    replicas: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.flat_stop is None:  # resolved, so that a JSON round trip compares equal
            object.__setattr__(self, "flat_stop", _numel(self.box_shape))
        if not math.isfinite(self.scale) or self.scale == 0.0:
            raise CheckpointError(
                f"shard piece of rank {self.rank} has scale {self.scale}: a zero or non-finite "
                "scale cannot be divided out to rebuild the tensor; store the values unscaled"
            )
        if self.rank in self.replicas or len(set(self.replicas)) != len(self.replicas):
            raise CheckpointError(
                f"shard piece of rank {self.rank} lists replicas {self.replicas}: each holder "
                "must appear once (the rank itself is not one of its replicas)"
            )

    @property
    def holders(self) -> tuple[int, ...]:
        """Every rank storing this piece: ``rank`` first, then ``replicas``."""
        return (self.rank, *self.replicas)

    @property
    def stop(self) -> int:
        """The resolved end of the flat range."""
        return _numel(self.box_shape) if self.flat_stop is None else self.flat_stop

    @property
    def numel(self) -> int:
        """Number of elements the rank stores for this piece."""
        return self.stop - self.flat_start

    def global_index(self, local_index: int) -> tuple[int, ...]:
        """Map element ``local_index`` of this piece to its coordinates in the global tensor."""
        if not 0 <= local_index < self.numel:
            raise IndexError(f"local index {local_index} outside piece of {self.numel} elements")
        flat = self.flat_start + local_index
        coords: list[int] = []
        for extent in reversed(self.box_shape):
            flat, rem = divmod(flat, extent)
            coords.append(rem)
        return tuple(o + c for o, c in zip(self.box_offset, reversed(coords), strict=True))

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict of this piece."""
        return {
            "rank": self.rank,
            "box_offset": list(self.box_offset),
            "box_shape": list(self.box_shape),
            "flat_start": self.flat_start,
            "flat_stop": self.stop,
            "local_offset": self.local_offset,
            "coords": list(self.coords),
            "scale": self.scale,
            "replicas": list(self.replicas),
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ShardPiece:
        """Read a piece written by `to_json`."""
        try:
            return cls(
                rank=int(data["rank"]),
                box_offset=tuple(int(x) for x in data["box_offset"]),
                box_shape=tuple(int(x) for x in data["box_shape"]),
                flat_start=int(data["flat_start"]),
                flat_stop=int(data["flat_stop"]),
                local_offset=int(data["local_offset"]),
                coords=tuple(int(x) for x in data.get("coords", ())),
                scale=float(data.get("scale", 1.0)),
                replicas=tuple(int(x) for x in data.get("replicas", ())),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(f"malformed shard piece {data!r}: {exc}") from exc


@dataclass(frozen=True)
class ShardMap:
    """How one logical tensor is spread over the ranks of a process group.

    Attributes:
        global_shape: Shape of the whole (unsharded) tensor.
        dtype: The element type as torch names it (``"float32"``, ``"bfloat16"``...).
        pieces: Every rank's pieces; a rank may hold several, several ranks may hold equal ones.
        axes: The mesh axes the pieces are spread over, outermost first (e.g. ``("dp",)``).
        mesh_axes: Every axis of the mesh, outermost first; empty when the map names no mesh.
        mesh_shape: The size of each of ``mesh_axes``.
    """

    global_shape: tuple[int, ...]
    dtype: str
    pieces: tuple[ShardPiece, ...]
    axes: tuple[str, ...] = field(default=())
    mesh_axes: tuple[str, ...] = field(default=())
    mesh_shape: tuple[int, ...] = field(default=())

    def __post_init__(self) -> None:
        self._check_mesh()
        for piece in self.pieces:
            self._check_piece(piece)
            self._check_coords(piece)

    def _check_mesh(self) -> None:
        if len(self.mesh_axes) != len(self.mesh_shape) or any(s < 1 for s in self.mesh_shape):
            raise CheckpointError(
                f"mesh_axes {self.mesh_axes} and mesh_shape {self.mesh_shape} must have one "
                "positive size per axis"
            )
        if self.mesh_axes and not set(self.axes) <= set(self.mesh_axes):
            raise CheckpointError(f"axes {self.axes} are not all in mesh_axes {self.mesh_axes}")

    def _check_coords(self, piece: ShardPiece) -> None:
        if not self.mesh_axes:
            if piece.coords:
                raise CheckpointError(
                    f"shard piece of rank {piece.rank} has coords {piece.coords} but the map "
                    "names no mesh (set mesh_axes and mesh_shape)"
                )
            return
        mesh = dict(zip(self.mesh_axes, self.mesh_shape, strict=True))
        if len(piece.coords) != len(mesh) or not all(
            0 <= c < s for c, s in zip(piece.coords, self.mesh_shape, strict=True)
        ):
            raise CheckpointError(
                f"shard piece of rank {piece.rank} has coords {piece.coords}, not one "
                f"coordinate inside each axis of the mesh {mesh}"
            )
        if self.axes and piece.rank != self._ravel(piece.coords, self.axes):
            raise CheckpointError(
                f"shard piece of rank {piece.rank} has coords {piece.coords}, which are rank "
                f"{self._ravel(piece.coords, self.axes)} of the group over {self.axes}"
            )

    def _ravel(self, coords: Sequence[int], axes: Sequence[str]) -> int:
        index = 0
        for axis in axes:
            position = self.mesh_axes.index(axis)
            index = index * self.mesh_shape[position] + coords[position]
        return index

    def global_rank(self, piece: ShardPiece) -> int:
        """The holder's rank in the whole mesh (row-major over ``mesh_axes``).

        Raises:
            CheckpointError: The map names no mesh.
        """
        if not self.mesh_axes:
            raise CheckpointError("this shard map names no mesh, so its pieces have no coords")
        return self._ravel(piece.coords, self.mesh_axes)

    def _check_piece(self, piece: ShardPiece) -> None:
        if len(piece.box_offset) != len(self.global_shape) or len(piece.box_shape) != len(
            self.global_shape
        ):
            raise CheckpointError(
                f"shard piece of rank {piece.rank} has {len(piece.box_shape)} dims, "
                f"the tensor has {len(self.global_shape)} ({self.global_shape})"
            )
        for dim, (off, ext, full) in enumerate(
            zip(piece.box_offset, piece.box_shape, self.global_shape, strict=True)
        ):
            if off < 0 or ext < 0 or off + ext > full:
                raise CheckpointError(
                    f"shard piece of rank {piece.rank} spans [{off}, {off + ext}) in dim {dim}, "
                    f"outside the tensor's extent {full}"
                )
        if not 0 <= piece.flat_start <= piece.stop <= _numel(piece.box_shape):
            raise CheckpointError(
                f"shard piece of rank {piece.rank} has flat range [{piece.flat_start}, "
                f"{piece.stop}) outside its box of {_numel(piece.box_shape)} elements"
            )

    @property
    def numel(self) -> int:
        """Number of elements of the global tensor."""
        return _numel(self.global_shape)

    def pieces_of(self, rank: int) -> tuple[ShardPiece, ...]:
        """The pieces that ``rank`` stores (as holder or replica), in local-storage order."""
        return tuple(
            sorted((p for p in self.pieces if rank in p.holders), key=lambda p: p.local_offset)
        )

    def iter_global_flat(self, piece: ShardPiece) -> Iterator[int]:
        """Row-major flat indices into the global tensor of each element of ``piece``."""
        strides = [_numel(self.global_shape[d + 1 :]) for d in range(len(self.global_shape))]
        for i in range(piece.numel):
            coords = piece.global_index(i)
            yield sum(c * s for c, s in zip(coords, strides, strict=True))

    def missing_elements(self) -> int:
        """How many global elements no rank holds (0 for a complete map).

        Walks every element, so use it in tests and checkpoint validation of small maps, not in
        a training step.
        """
        held = bytearray(self.numel)
        for piece in self.pieces:
            for index in self.iter_global_flat(piece):
                held[index] = 1
        return self.numel - sum(held)

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict of the map (what checkpoints store next to the tensors)."""
        return {
            "format_version": SHARD_MAP_FORMAT_VERSION,
            "global_shape": list(self.global_shape),
            "dtype": self.dtype,
            "axes": list(self.axes),
            "mesh_axes": list(self.mesh_axes),
            "mesh_shape": list(self.mesh_shape),
            "pieces": [p.to_json() for p in self.pieces],
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ShardMap:
        """Read a map written by `to_json`; malformed input is a ``CheckpointError``."""
        version = data.get("format_version", 1) if isinstance(data, dict) else None
        if not isinstance(version, int) or not 1 <= version <= SHARD_MAP_FORMAT_VERSION:
            raise CheckpointError(
                f"shard map format_version {version!r} is not one this DeepShard reads "
                f"(1..{SHARD_MAP_FORMAT_VERSION}); upgrade deepshard-interface to read it"
            )
        try:
            return cls(
                global_shape=tuple(int(x) for x in data["global_shape"]),
                dtype=str(data["dtype"]),
                axes=tuple(str(a) for a in data.get("axes", ())),
                mesh_axes=tuple(str(a) for a in data.get("mesh_axes", ())),
                mesh_shape=tuple(int(x) for x in data.get("mesh_shape", ())),
                pieces=tuple(ShardPiece.from_json(p) for p in data["pieces"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(f"malformed shard map: {exc}") from exc

    @classmethod
    def replicated(
        cls, global_shape: Sequence[int], dtype: str, ranks: Sequence[int], *, scale: float = 1.0
    ) -> ShardMap:
        """A tensor every rank in ``ranks`` holds whole, each as ``full * scale``.

        The scale belongs to the replicated map: layouts that pre-divide a value (a row-parallel
        bias) hold it whole on every rank, while the weight split beside it stays unscaled.
        """
        shape = tuple(global_shape)
        zero = tuple(0 for _ in shape)
        return cls(shape, dtype, tuple(ShardPiece(r, zero, shape, scale=scale) for r in ranks))

    @classmethod
    def even_split(
        cls, global_shape: Sequence[int], dtype: str, *, dim: int, world_size: int
    ) -> ShardMap:
        """Rank ``r`` of ``world_size`` holds the ``r``-th of equal slices along ``dim``.

        This is tensor parallelism's column or row split. ``global_shape[dim]`` must divide;
        a negative ``dim`` counts from the end, as in torch.
        """
        shape = tuple(global_shape)
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise CheckpointError(f"world_size must be an int >= 1, got {world_size!r}")
        if not -len(shape) <= dim < len(shape):
            raise CheckpointError(f"dim {dim} is out of range for a tensor of shape {shape}")
        dim %= len(shape)
        if shape[dim] % world_size:
            raise CheckpointError(
                f"dimension {dim} of size {shape[dim]} does not split evenly "
                f"over {world_size} ranks"
            )
        step = shape[dim] // world_size
        pieces = []
        for rank in range(world_size):
            offset = tuple(rank * step if d == dim else 0 for d in range(len(shape)))
            box = tuple(step if d == dim else shape[d] for d in range(len(shape)))
            pieces.append(ShardPiece(rank, offset, box))
        return cls(shape, dtype, tuple(pieces))

    @classmethod
    def flat_partition(
        cls, global_shape: Sequence[int], dtype: str, *, bounds: Sequence[tuple[int, int, int]]
    ) -> ShardMap:
        """ZeRO's layout: each ``(rank, start, stop)`` holds that flat range of the tensor."""
        shape = tuple(global_shape)
        zero = tuple(0 for _ in shape)
        pieces = tuple(ShardPiece(r, zero, shape, start, stop) for r, start, stop in bounds)
        return cls(shape, dtype, pieces)

    @classmethod
    def contiguous_split(
        cls, global_shape: Sequence[int], dtype: str, *, dim: int, sizes: Sequence[int]
    ) -> ShardMap:
        """Rank ``r`` holds the next ``sizes[r]`` slices along ``dim`` (uneven sizes allowed)."""
        return _shard_layout.contiguous_split(global_shape, dtype, dim=dim, sizes=sizes)

    @classmethod
    def sub_parameter(
        cls,
        global_shape: Sequence[int],
        dtype: str,
        *,
        dim: int,
        parts: Sequence[int],
        world_size: int,
    ) -> ShardMap:
        """A fused parameter (QKV, gate_up) whose ``parts`` along ``dim`` are each split."""
        return _shard_layout.sub_parameter(
            global_shape, dtype, dim=dim, parts=parts, world_size=world_size
        )

    @classmethod
    def flat_buffer(
        cls, shapes: Sequence[Sequence[int]], dtype: str, *, world_size: int, alignment: int = 1
    ) -> list[ShardMap]:
        """ZeRO's flat layout: one map per tensor of a buffer cut into equal rank partitions."""
        return _shard_layout.flat_buffer(shapes, dtype, world_size=world_size, alignment=alignment)

    def runs(self, piece: ShardPiece) -> list[tuple[int, int, int]]:
        """``(global_flat_start, local_flat_start, length)`` of each contiguous run of ``piece``."""
        return _shard_layout.piece_runs(piece, self.global_shape)

    def validate_coverage(self, data: Mapping[int, Sequence[float]] | None = None) -> None:
        """Raise `CheckpointError` unless every element is held exactly once, up to replicas.

        Gaps, overlaps of differently cut pieces and replicas with different scales fail;
        given ``data`` (each rank's flat local storage), so do replicas with different values.
        """
        _shard_layout.validate_coverage(self, data)

    def extract(self, full: Sequence[float], rank: int, *, linear: bool = True) -> list[float]:
        """``rank``'s flat local storage cut from the row-major ``full`` tensor.

        ``linear`` is True for parameters and their fp32 masters (stored as ``full * scale``);
        optimizer state (moments, momentum) passes False and is refused when a piece is scaled.
        """
        return _shard_layout.extract(self, full, rank, linear=linear)

    def rebuild(self, shards: Mapping[int, Sequence[float]], *, linear: bool = True) -> list[float]:
        """The row-major full tensor from every rank's flat local storage (checks coverage)."""
        return _shard_layout.rebuild(self, shards, linear=linear)
