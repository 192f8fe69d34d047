"""How ranks are laid out over the parallel axes: pipeline, data, expert, sequence, tensor.

The five axes form a row-major grid in the order of `Topology.AXES`, outermost first:
``pp, dp, ep, sp, tp``. Tensor parallelism is innermost, so tensor-parallel peers are adjacent
ranks (the same node, the fastest links); pipeline stages are outermost. A rank's coordinates
are the digits of its number in the mixed radix given by `Topology.shape`.

Dense parameters are replicated, and their gradients averaged, over ``dp × ep × sp``
(`Topology.dense_dp_axes`): expert-parallel ranks hold different experts but the same
dense layers, and sequence-parallel ranks hold the same weights and see different slices of
the same samples. Expert parameters are replicated over ``dp`` only
(`Topology.expert_dp_axes`). Ranks that read different samples span ``dp × ep``
(`Topology.batch_world_size`), which is the world the batch sizes are reconciled for.

This module is pure arithmetic; ``deepshard.comm.build_mesh`` turns a Topology into a
``DeviceMesh`` whose dimension names are `Topology.AXES`.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from deepshard.interface.errors import TopologyError

__all__ = ["Topology"]


class Topology(BaseModel):
    """Sizes of the five parallel axes; their product is the world size.

    Example:
        >>> topo = Topology.from_world(8, tp=2)
        >>> topo.shape, topo.coords(5)["tp"], topo.ranks_along("tp", 5)
        ((1, 4, 1, 1, 2), 1, (4, 5))
    """

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    AXES: ClassVar[tuple[str, ...]] = ("pp", "dp", "ep", "sp", "tp")
    """Mesh axis names, outermost first (tp innermost: its peers are adjacent ranks)."""

    dense_dp_axes: ClassVar[tuple[str, ...]] = ("dp", "ep", "sp")
    """Axes over which dense (non-expert) parameters are replicated and gradients averaged."""

    expert_dp_axes: ClassVar[tuple[str, ...]] = ("dp",)
    """Axes over which expert parameters are replicated and gradients averaged."""

    pp: int = Field(1, ge=1)
    """Pipeline-parallel degree (reserved; DeepShard has no pipeline engine, so keep 1)."""

    dp: int = Field(1, ge=1)
    """Data-parallel degree (the replicas that ZeRO shards over, besides ep and sp)."""

    ep: int = Field(1, ge=1)
    """Expert-parallel degree: ranks the experts of a MoE layer are spread over."""

    sp: int = Field(1, ge=1)
    """Sequence-parallel (Ulysses) degree: ranks that split each sequence."""

    tp: int = Field(1, ge=1)
    """Tensor-parallel degree: ranks that split each weight matrix."""

    def __init__(self, /, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as exc:
            problems = "; ".join(
                f"{'.'.join(map(str, e['loc']))}: {e['msg']} (got {e.get('input')!r})"
                for e in exc.errors(include_url=False)
            )
            raise TopologyError(f"invalid topology: {problems}") from exc

    @classmethod
    def from_world(
        cls, world_size: int, *, tp: int = 1, ep: int = 1, sp: int = 1, pp: int = 1
    ) -> Topology:
        """Builds the topology whose dp fills the world once the other axes are fixed.

        Args:
            world_size: Total number of ranks.
            tp: Tensor-parallel degree.
            ep: Expert-parallel degree.
            sp: Sequence-parallel degree.
            pp: Pipeline-parallel degree.

        Returns:
            The topology with ``dp = world_size / (pp × ep × sp × tp)``.

        Raises:
            TopologyError: A size is not a positive integer, or the world is not a multiple of
                the other axes' product.
        """
        for name, size in (
            ("world_size", world_size),
            ("tp", tp),
            ("ep", ep),
            ("sp", sp),
            ("pp", pp),
        ):
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise TopologyError(f"{name} must be a positive integer, got {size!r}")
        others = pp * ep * sp * tp
        if world_size % others:
            raise TopologyError(
                f"world size {world_size} is not divisible by pp {pp} × ep {ep} × sp {sp} × "
                f"tp {tp} = {others}; change the world size or the parallel degrees"
            )
        return cls(pp=pp, dp=world_size // others, ep=ep, sp=sp, tp=tp)

    @property
    def shape(self) -> tuple[int, ...]:
        """Axis sizes in `AXES` order."""
        return tuple(getattr(self, axis) for axis in self.AXES)

    @property
    def axis_names(self) -> tuple[str, ...]:
        """The axis names, `AXES`."""
        return self.AXES

    @property
    def world_size(self) -> int:
        """Total number of ranks: the product of the axis sizes."""
        return math.prod(self.shape)

    @property
    def dense_dp_size(self) -> int:
        """Replicas of a dense parameter: dp × ep × sp."""
        return self.dp * self.ep * self.sp

    @property
    def batch_world_size(self) -> int:
        """Ranks that read their own micro-batch: dp × ep (tp and sp peers share samples)."""
        return self.dp * self.ep

    def check_world(self, world_size: int) -> None:
        """Checks that this topology covers exactly ``world_size`` ranks.

        Args:
            world_size: The number of ranks actually running.

        Raises:
            TopologyError: The two numbers differ.
        """
        if world_size != self.world_size:
            raise TopologyError(
                f"topology {dict(zip(self.AXES, self.shape, strict=True))} covers "
                f"{self.world_size} ranks but the world has {world_size}"
            )

    def _check_rank(self, rank: int) -> None:
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise TopologyError(f"rank {rank!r} is outside 0..{self.world_size - 1}")

    def _check_axis(self, axis: str) -> None:
        if axis not in self.AXES:
            raise TopologyError(f"unknown axis {axis!r}; the axes are {', '.join(self.AXES)}")

    def coords(self, rank: int) -> dict[str, int]:
        """Returns the coordinate of ``rank`` on every axis (row-major, tp fastest).

        Args:
            rank: A global rank in ``0 .. world_size - 1``.

        Returns:
            ``{"pp": ..., "dp": ..., "ep": ..., "sp": ..., "tp": ...}``.

        Raises:
            TopologyError: The rank is out of range.
        """
        self._check_rank(rank)
        result: dict[str, int] = {}
        remainder = rank
        for axis, size in reversed(tuple(zip(self.AXES, self.shape, strict=True))):
            remainder, result[axis] = divmod(remainder, size)
        return {axis: result[axis] for axis in self.AXES}

    def rank_of(self, **coords: int) -> int:
        """Returns the global rank at the given coordinates (omitted axes count as 0).

        Args:
            **coords: Coordinates by axis name, e.g. ``dp=1, tp=0``.

        Returns:
            The global rank.

        Raises:
            TopologyError: An unknown axis, or a coordinate outside its axis.
        """
        rank = 0
        for axis in coords:
            self._check_axis(axis)
        for axis, size in zip(self.AXES, self.shape, strict=True):
            index = coords.get(axis, 0)
            if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < size:
                raise TopologyError(f"coordinate {axis}={index!r} is outside 0..{size - 1}")
            rank = rank * size + index
        return rank

    def ranks_along(self, axis: str, rank: int) -> tuple[int, ...]:
        """Returns the ranks that differ from ``rank`` only on ``axis`` (its group on that axis).

        Args:
            axis: One of `AXES`.
            rank: A global rank.

        Returns:
            The group's ranks in ascending order, ``rank`` included.

        Raises:
            TopologyError: Unknown axis or rank out of range.
        """
        self._check_axis(axis)
        base = self.coords(rank)
        return tuple(self.rank_of(**{**base, axis: index}) for index in range(getattr(self, axis)))
