"""How long stage-3 parameter gathers kept this rank waiting, and how often prefetch was ahead.

A gather the forward or backward hooks need *now* blocks the rank until its all-gather
completes; that blocked time is the gather's *exposed* part. Prefetch exists to shrink it: a
gather issued a unit earlier runs while that unit computes, so by the time its own unit starts,
the wait is short or nothing. The comms logger times each all-gather from issue to completion
(its whole latency); `GatherWaits` times only the blocking waits, so the two together say how
much of the gather time compute hid.

The clock runs only around a wait on a gather still in flight (a gathered or resident unit costs
one set lookup). On a host backend (gloo) that wait is the real blocked time. On an accelerator
the wait only orders the streams (the host does not block unless something synchronises), so
the figure is the host's share, not the device's.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

__all__ = ["GatherWaits"]


@dataclass
class GatherWaits:
    """Running totals of a `ShardedModule`'s blocking gather waits (never reset; take deltas).

    Attributes:
        clock: Monotonic seconds.
        exposed_s: Seconds spent blocked waiting for all-gathers a hook (or a
            `GatheredParameters` block) needed.
        waits: Needed units whose gather had been started and not yet waited for.
        prefetched: Gathers started ahead of use by prefetch.
        prefetch_hits: Needed units whose gather prefetch had started before they were needed.
    """

    clock: Callable[[], float] = field(default=time.perf_counter, repr=False)
    exposed_s: float = 0.0
    waits: int = 0
    prefetched: int = 0
    prefetch_hits: int = 0

    @property
    def exposed_gather_s(self) -> float:
        """``exposed_s``: what `deepshard.profiler.WallClockTimers` reads (its protocol's name)."""
        return self.exposed_s
