"""Per-parameter placements: how each parameter is laid out over the mesh axes.

A `ParamPlacement` says, for one parameter, what the whole (logical) tensor is and how the
ranks of every mesh axis share it:

* `Replicate` — every rank along the axis holds the same values;
* `Shard` ``(dim)`` — rank ``i`` along the axis holds the ``i``-th of equal slices along tensor
  dimension ``dim`` (tensor parallelism's row or column split; expert parallelism's split of a
  stacked expert tensor). Several axes sharding one dim nest in mesh order, outermost first.
  A fused weight (``gate_up_proj``, a fused QKV) is ``Shard(dim, parts)``: ``dim`` is several
  sub-parameters back to back, each cut into equal slices on its own, and rank ``i`` stores its
  ``i``-th slice of each, back to back. Its local tensor is then not one box of the global
  tensor but several (`ParamPlacement.local_boxes`, in storage order: one per part, or, when
  dims before ``dim`` have more than one index — a stack of experts — one per index and part);
* `FlatShard` — the ranks along the axes marked so, flattened in mesh order, each hold one
  contiguous row-major range of the rank's box, cut at arbitrary element boundaries (ZeRO's
  flat partitions). Where the cuts fall is the owner's business and is recorded in its shard
  maps, not here.

It also names the axes its gradient is reduced over (``reduce_over``): ``dp × ep × sp`` for a
dense parameter, ``dp`` for an expert (`Topology.dense_dp_axes`, `Topology.expert_dp_axes`).
A parameter replicated along an axis whose ranks each compute only part of its gradient (a
norm weight applied to every local attention head under tensor parallelism, Hugging Face's
``replicated_with_grad_allreduce``) names that axis in ``sum_over``: its gradient is *summed*
there, while ``reduce_over`` *averages* (the two commute, so the owner may do either first).

Placements live in a `PlacementRegistry` keyed by the parameter's fully qualified name, never
on the parameter itself: the packages that parallelise a model (AutoTP, AutoEP) write them,
ZeRO and the checkpoint package read them, and shard maps are derived from them. Nothing here
imports torch; the registry of a plain model is built from anything with ``shape`` and
``dtype``.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from deepshard.interface._axis_placements import (
    AxisPlacement,
    FlatShard,
    Replicate,
    Shard,
    axis_from_json,
    axis_to_json,
)
from deepshard.interface.errors import CheckpointError, TopologyError
from deepshard.interface.topology import Topology

__all__ = [
    "AxisPlacement",
    "FlatShard",
    "ParamPlacement",
    "PlacementRegistry",
    "Replicate",
    "Shard",
]


@dataclass(frozen=True)
class ParamPlacement:
    """Where one parameter lives on the mesh: its logical tensor, per-axis split, reductions.

    Example:
        >>> from deepshard.interface import Topology
        >>> column = ParamPlacement.replicated((8, 4), "bfloat16").with_axis("tp", Shard(0))
        >>> column.local_shape(Topology(dp=2, tp=2))
        (4, 4)
    """

    global_shape: tuple[int, ...]
    """Shape of the whole (logical, unsharded) parameter."""

    dtype: str
    """Its element type as torch names it (``"float32"``, ``"bfloat16"``...)."""

    placements: tuple[AxisPlacement, ...]
    """How each axis of `axes` shares it, in the same order."""

    reduce_over: tuple[str, ...]
    """The axes whose ranks together form its gradient-reduction group, in mesh order."""

    axes: tuple[str, ...] = field(default=Topology.AXES)
    """The mesh axes `placements` refers to, outermost first."""

    sum_over: tuple[str, ...] = ()
    """Axes (replicated, outside `reduce_over`) whose ranks each hold a partial sum of the
    gradient, which is summed over them (``("tp",)`` for Qwen3's ``q_norm``/``k_norm``)."""

    def __post_init__(self) -> None:
        if any(isinstance(s, bool) or not isinstance(s, int) or s < 0 for s in self.global_shape):
            raise TopologyError(f"global_shape must be non-negative ints, got {self.global_shape}")
        if len(set(self.axes)) != len(self.axes) or len(self.placements) != len(self.axes):
            raise TopologyError(
                f"a placement needs one entry per distinct mesh axis: axes {self.axes}, "
                f"placements {self.placements}"
            )
        for axis, placement in zip(self.axes, self.placements, strict=True):
            if not isinstance(placement, (Replicate, Shard, FlatShard)):
                raise TopologyError(
                    f"axis {axis!r}: {placement!r} is not Replicate(), Shard(dim) or FlatShard()"
                )
            if isinstance(placement, Shard) and not (
                isinstance(placement.dim, int) and 0 <= placement.dim < len(self.global_shape)
            ):
                raise TopologyError(
                    f"axis {axis!r}: Shard({placement.dim}) is outside the "
                    f"{len(self.global_shape)} dims of a tensor of shape {self.global_shape}"
                )
        self._check_parts()
        self._check_reduction()

    def _check_parts(self) -> None:
        for axis, placement in zip(self.axes, self.placements, strict=True):
            if not isinstance(placement, Shard) or not placement.parts:
                continue
            dim, parts = placement.dim, placement.parts
            if any(isinstance(n, bool) or not isinstance(n, int) or n <= 0 for n in parts) or (
                sum(parts) != self.global_shape[dim]
            ):
                raise TopologyError(
                    f"axis {axis!r}: Shard({dim}, parts={parts}) must name positive extents "
                    f"adding up to dimension {dim} of {self.global_shape}"
                )
            others = [
                a
                for a, p in zip(self.axes, self.placements, strict=True)
                if a != axis and isinstance(p, Shard) and p.dim == dim
            ]
            if others:
                raise TopologyError(
                    f"axis {axis!r}: a fused Shard({dim}, parts=...) cannot share dimension "
                    f"{dim} with the Shard({dim}) of {others}; split another dimension there"
                )

    def _check_reduction(self) -> None:
        unknown = [a for a in self.reduce_over if a not in self.axes]
        if unknown or len(set(self.reduce_over)) != len(self.reduce_over):
            raise TopologyError(
                f"reduce_over {self.reduce_over} must name distinct axes of {self.axes}"
            )
        if list(self.reduce_over) != [a for a in self.axes if a in self.reduce_over]:
            raise TopologyError(f"reduce_over {self.reduce_over} must follow the order {self.axes}")
        sharded = [a for a in self.reduce_over if isinstance(self.placement(a), Shard)]
        if sharded:
            raise TopologyError(
                f"axes {sharded} both shard the parameter and reduce its gradient; ranks along "
                "a reduction axis hold replicas: use Replicate() or FlatShard() there, or take "
                "the axis out of reduce_over"
            )
        self._check_sum_over()
        loose = [a for a in self.flat_shard_axes if a not in self.reduce_over]
        if loose:
            raise TopologyError(
                f"FlatShard() on {loose}, which are not in reduce_over {self.reduce_over}: a "
                "flat partition is cut over the ranks that would otherwise hold replicas"
            )

    def _check_sum_over(self) -> None:
        bad = [
            a
            for a in self.sum_over
            if a not in self.axes or a in self.reduce_over or self.placement(a) != Replicate()
        ]
        if bad or len(set(self.sum_over)) != len(self.sum_over):
            raise TopologyError(
                f"sum_over {self.sum_over}: {bad or 'repeated axes'} must be distinct axes of "
                f"{self.axes} outside reduce_over {self.reduce_over} that replicate the "
                "parameter (partial gradients are summed over replicas)"
            )

    @classmethod
    def replicated(
        cls,
        global_shape: Sequence[int],
        dtype: str,
        *,
        reduce_over: Sequence[str] = Topology.dense_dp_axes,
        axes: Sequence[str] = Topology.AXES,
    ) -> ParamPlacement:
        """A parameter every rank holds whole (a plain model's), reduced over ``reduce_over``."""
        return cls(
            tuple(global_shape), dtype, (Replicate(),) * len(axes), tuple(reduce_over), tuple(axes)
        )

    def placement(self, axis: str) -> AxisPlacement:
        """How ``axis`` shares the parameter.

        Raises:
            TopologyError: ``axis`` is not one of `axes`.
        """
        if axis not in self.axes:
            raise TopologyError(f"unknown axis {axis!r}; the placement's axes are {self.axes}")
        return self.placements[self.axes.index(axis)]

    def with_axis(self, axis: str, placement: AxisPlacement) -> ParamPlacement:
        """A copy with ``axis`` shared as ``placement`` (``Shard(0)`` for a column split...)."""
        self.placement(axis)
        chosen = tuple(
            placement if a == axis else p for a, p in zip(self.axes, self.placements, strict=True)
        )
        return replace(self, placements=chosen)

    @property
    def flat_shard_axes(self) -> tuple[str, ...]:
        """The axes marked `FlatShard`, in mesh order."""
        return tuple(
            a for a, p in zip(self.axes, self.placements, strict=True) if isinstance(p, FlatShard)
        )

    def _sizes(self, topology: Topology) -> dict[str, int]:
        if tuple(self.axes) != topology.axis_names:
            raise TopologyError(
                f"the placement's axes {self.axes} are not the topology's {topology.axis_names}"
            )
        return dict(zip(topology.axis_names, topology.shape, strict=True))

    def _cut(
        self, topology: Topology, coords: Mapping[str, int]
    ) -> tuple[list[int], list[int], tuple[int, int, int, tuple[int, ...]] | None]:
        """The rank's box before any fused split, and the fused split still to make (dim,
        ranks, coordinate, parts), if any."""
        sizes = self._sizes(topology)
        offset, shape = [0] * len(self.global_shape), list(self.global_shape)
        fused = None
        for axis, placement in zip(self.axes, self.placements, strict=True):
            if not isinstance(placement, Shard) or sizes[axis] == 1:
                continue
            dim, size = placement.dim, sizes[axis]
            extents = placement.parts or (shape[dim],)
            if any(n % size for n in extents):
                what = f"parts {extents} of" if placement.parts else "dimension"
                raise TopologyError(
                    f"Shard({dim}) on axis {axis!r}: {what} {dim} of extent {shape[dim]} "
                    f"(global shape {self.global_shape}) does not split evenly over {size} ranks"
                )
            if placement.parts:
                fused = (dim, size, coords[axis], placement.parts)
                continue
            shape[dim] //= size
            offset[dim] += coords[axis] * shape[dim]
        return offset, shape, fused

    def local_boxes(
        self, topology: Topology, coords: Mapping[str, int]
    ) -> tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]:
        """The boxes of the global tensor the rank at ``coords`` holds, in storage order.

        One box, unless a fused ``Shard(dim, parts)`` splits it: then one box per part (its
        slice), or, when the dims before ``dim`` have more than one index, one per index (row
        major) and part — the rank's local tensor is those boxes back to back.

        Args:
            topology: The axis sizes.
            coords: The rank's coordinate on every axis (`Topology.coords`).

        Raises:
            TopologyError: As `local_box`.
        """
        offset, shape, fused = self._cut(topology, coords)
        if fused is None:
            return ((tuple(offset), tuple(shape)),)
        dim, size, at, parts = fused
        boxes = []
        for lead in itertools.product(*(range(n) for n in shape[:dim])):
            start = 0
            for part in parts:
                box_offset = [*(o + i for o, i in zip(offset, lead, strict=False)), *offset[dim:]]
                box_offset[dim] = start + at * (part // size)
                box_shape = [*(1 for _ in lead), *shape[dim:]]
                box_shape[dim] = part // size
                boxes.append((tuple(box_offset), tuple(box_shape)))
                start += part
        return tuple(boxes)

    def local_box(
        self, topology: Topology, coords: Mapping[str, int]
    ) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The box of the global tensor that the rank at ``coords`` holds (before any FlatShard).

        Args:
            topology: The axis sizes.
            coords: The rank's coordinate on every axis (`Topology.coords`).

        Returns:
            ``(box_offset, box_shape)``, one entry per tensor dimension.

        Raises:
            TopologyError: The axes differ from the topology's, a sharded dim does not split
                evenly over its axis, or a fused split makes the local tensor several boxes
                (`local_boxes`).
        """
        boxes = self.local_boxes(topology, coords)
        if len(boxes) != 1:
            raise TopologyError(
                f"a fused split of {self.global_shape} gives each rank {len(boxes)} boxes, not "
                "one; read them with ParamPlacement.local_boxes"
            )
        return boxes[0]

    def local_shape(self, topology: Topology) -> tuple[int, ...]:
        """The shape of the tensor each rank holds (equal on every rank: splits are even; a
        fused split's slices lie back to back along its dim)."""
        _, shape, fused = self._cut(topology, dict.fromkeys(topology.axis_names, 0))
        if fused is not None:
            dim, size, _, _ = fused
            shape[dim] //= size
        return tuple(shape)

    @property
    def numel(self) -> int:
        """Elements of the whole parameter."""
        return math.prod(self.global_shape)

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (what checkpoints store)."""
        data: dict[str, Any] = {
            "global_shape": list(self.global_shape),
            "dtype": self.dtype,
            "axes": list(self.axes),
            "placements": [axis_to_json(p) for p in self.placements],
            "reduce_over": list(self.reduce_over),
        }
        if self.sum_over:  # absent means none: older readers and files stay as they were
            data["sum_over"] = list(self.sum_over)
        return data

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ParamPlacement:
        """Read a placement written by `to_json`; malformed input is a ``CheckpointError``."""
        try:
            return cls(
                global_shape=tuple(int(x) for x in data["global_shape"]),
                dtype=str(data["dtype"]),
                axes=tuple(str(a) for a in data["axes"]),
                placements=tuple(axis_from_json(p) for p in data["placements"]),
                reduce_over=tuple(str(a) for a in data["reduce_over"]),
                sum_over=tuple(str(a) for a in data.get("sum_over", ())),
            )
        except (KeyError, TypeError, ValueError, TopologyError) as exc:
            raise CheckpointError(f"malformed parameter placement {dict(data)!r}: {exc}") from exc


def _dtype_name(dtype: object) -> str:
    return str(dtype).removeprefix("torch.")


class PlacementRegistry(Mapping[str, ParamPlacement]):
    """Every parameter's `ParamPlacement`, by fully qualified name, for one model and topology.

    Writers (the parallelising packages) `set` placements; readers look them up by name. It is
    an object passed along with the model, never process-global state.

    Args:
        topology: The axis sizes every placement is checked against.
        placements: Initial placements by name.

    Raises:
        TopologyError: A placement does not fit ``topology``.
    """

    def __init__(
        self, topology: Topology, placements: Mapping[str, ParamPlacement] | None = None
    ) -> None:
        self._topology = topology
        self._placements: dict[str, ParamPlacement] = {}
        for name, placement in (placements or {}).items():
            self.set(name, placement)

    @classmethod
    def replicated(
        cls,
        named_parameters: Iterable[tuple[str, Any]],
        topology: Topology,
        *,
        reduce_over: Sequence[str] = Topology.dense_dp_axes,
    ) -> PlacementRegistry:
        """The registry of a plain model: every parameter whole on every rank.

        Args:
            named_parameters: ``model.named_parameters()`` (anything with ``shape``, ``dtype``).
            topology: The axis sizes.
            reduce_over: The reduction axes of every parameter (the dense data-parallel ones).
        """
        return cls(
            topology,
            {
                name: ParamPlacement.replicated(
                    tuple(int(s) for s in param.shape),
                    _dtype_name(param.dtype),
                    reduce_over=reduce_over,
                )
                for name, param in named_parameters
            },
        )

    @property
    def topology(self) -> Topology:
        """The axis sizes the placements are laid out on."""
        return self._topology

    def set(self, name: str, placement: ParamPlacement) -> None:
        """Record (or replace) the placement of the parameter ``name``.

        Raises:
            TopologyError: Its axes are not the topology's, or a sharded dim does not split.
        """
        placement.local_shape(self._topology)
        self._placements[name] = placement

    def require(self, name: str) -> ParamPlacement:
        """The placement of ``name``, or a `TopologyError` saying how to provide one."""
        if name not in self._placements:
            raise TopologyError(
                f"parameter {name!r} has no placement in the registry; build the registry "
                "from the same model (PlacementRegistry.replicated(model.named_parameters(), "
                "topology)) after parallelising it, and pass names for every parameter"
            )
        return self._placements[name]

    def __getitem__(self, name: str) -> ParamPlacement:
        return self._placements[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._placements)

    def __len__(self) -> int:
        return len(self._placements)
