"""How one mesh axis shares a parameter: `Replicate`, `Shard` (plain or fused) or `FlatShard`,
and their JSON form (see `deepshard.interface.placement` for what each means)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeAlias

__all__ = [
    "AxisPlacement",
    "FlatShard",
    "Replicate",
    "Shard",
    "axis_from_json",
    "axis_to_json",
]


@dataclass(frozen=True)
class Replicate:
    """Every rank along the axis holds the same values."""


@dataclass(frozen=True)
class Shard:
    """Rank ``i`` along the axis holds the ``i``-th of equal slices along tensor dim ``dim``
    (of each of ``parts``, for a fused weight)."""

    dim: int
    """The sliced tensor dimension (non-negative)."""

    parts: tuple[int, ...] = ()
    """Extents of the sub-parameters ``dim`` is made of, in order (``(I, I)`` for a fused
    ``gate_up_proj``; ``(q, k, v)`` rows for a fused QKV); they add up to the dim's extent.
    Empty (the default) means one part: the plain split."""


@dataclass(frozen=True)
class FlatShard:
    """Each rank along the axis holds one row-major flat range of its box (ZeRO's partitions)."""


AxisPlacement: TypeAlias = Replicate | Shard | FlatShard
"""How one mesh axis shares a parameter."""

_KINDS: dict[str, type[Replicate] | type[FlatShard]] = {
    "replicate": Replicate,
    "flat_shard": FlatShard,
}


def axis_to_json(placement: AxisPlacement) -> dict[str, Any]:
    if isinstance(placement, Shard):
        data: dict[str, Any] = {"kind": "shard", "dim": placement.dim}
        if placement.parts:  # absent means one part: older readers and files stay as they were
            data["parts"] = list(placement.parts)
        return data
    return {"kind": "replicate" if isinstance(placement, Replicate) else "flat_shard"}


def axis_from_json(data: Mapping[str, Any]) -> AxisPlacement:
    kind = data["kind"]
    if kind == "shard":
        return Shard(int(data["dim"]), tuple(int(n) for n in data.get("parts", ())))
    if kind not in _KINDS:
        raise ValueError(f"unknown placement kind {kind!r} (replicate, shard, flat_shard)")
    return _KINDS[kind]()
