"""Algorithmic and bus bandwidth of one collective, with the nccl-tests conventions.

nccl-tests (doc/PERFORMANCE.md) reports two numbers per call. The *algorithmic bandwidth* is the
message size over the time, `algbw = bytes / seconds`. The *bus bandwidth* rescales it by how
much data each rank must move over its links for that collective on `n` ranks, so that one number
compares across ops and world sizes with the hardware's peak:

=========================  ==================================  =============
op                         bytes counted                       busbw factor
=========================  ==================================  =============
all_reduce                 the tensor                          2 (n - 1) / n
all_gather_into_tensor     the full gathered output            (n - 1) / n
reduce_scatter_tensor      the full (unscattered) input        (n - 1) / n
all_to_all_single          the input this rank sends           (n - 1) / n
broadcast                  the tensor                          1
barrier                    0                                   0
=========================  ==================================  =============

An op not in the table (a custom collective logged by name) gets factor 1 and a note saying so;
it is never an error.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["Bandwidth", "bandwidth", "bus_factor", "known_ops"]


def _ring(n: int) -> float:
    return (n - 1) / n


_FACTORS: dict[str, Callable[[int], float]] = {
    "all_reduce": lambda n: 2 * _ring(n),
    "all_gather_into_tensor": _ring,
    "all_gather": _ring,
    "reduce_scatter_tensor": _ring,
    "reduce_scatter": _ring,
    "all_to_all_single": _ring,
    "all_to_all": _ring,
    "broadcast": lambda n: 1.0,
    "barrier": lambda n: 0.0,
}


def known_ops() -> tuple[str, ...]:
    """The op names with a bus-bandwidth factor of their own."""
    return tuple(_FACTORS)


def bus_factor(op: str, world_size: int) -> tuple[float, str | None]:
    """The factor from algorithmic to bus bandwidth for `op` on `world_size` ranks.

    Args:
        op: The collective's name, e.g. `"all_reduce"`.
        world_size: Ranks in the group the collective ran on (>= 1).

    Returns:
        `(factor, note)`; `note` is `None` for a known op and explains the fallback otherwise.
    """
    factor = _FACTORS.get(op)
    if factor is None:
        return 1.0, f"unknown op {op!r}: bus bandwidth factor 1 assumed"
    return factor(world_size), None


@dataclass(frozen=True)
class Bandwidth:
    """Bandwidths of one call, in bytes per second."""

    algbw: float
    """Algorithmic bandwidth: bytes / latency."""
    busbw: float
    """Bus bandwidth: `algbw` times the op's factor."""
    note: str | None = None
    """Why the factor is a fallback (unknown op), else `None`."""


def bandwidth(op: str, msg_bytes: int, latency_s: float, world_size: int) -> Bandwidth:
    """Algorithmic and bus bandwidth of one call of `op`.

    Args:
        op: The collective's name.
        msg_bytes: Bytes counted for the call as in the module table.
        latency_s: Seconds from issue to completion of that call.
        world_size: Ranks in the group.

    Returns:
        The bandwidths; both are 0 when the latency is not positive (nothing measurable).
    """
    factor, note = bus_factor(op, world_size)
    algbw = msg_bytes / latency_s if latency_s > 0 else 0.0
    return Bandwidth(algbw=algbw, busbw=algbw * factor, note=note)
