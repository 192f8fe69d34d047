"""The training wall-clock breakdown: forward, backward, reduce and step time per optimizer step.

The engine wraps its phases in ``timers.time("forward" | "backward" | "step")`` and calls
``end_step()`` at each optimizer step. Forward, backward and step are wall-clock seconds with the
device synchronised at both ends of each timed block. "reduce" is not a block of its own (ZeRO
reduces inside backward and step): it is the summed latency of the reduction collectives the
comms logger recorded *during that step*, read at ``end_step`` from the records the step added.
Nothing matches log names. When more calls were logged in one step than the logger keeps records
of, the calls without a record are counted and shown in the line ("N untimed") instead of being
dropped silently.

At ZeRO stage 3 the engine also passes a `GatherWaitSource` (the `ShardedModule`'s running total
of seconds spent blocked waiting for parameter all-gathers) and the line gains two figures:
"gather (exposed)", that total's growth during the step, and "gather (total)", the summed
latency of the step's all-gathers from the comms records. Prefetch works when exposed is a
small part of total: the rest ran while the rank computed.

The logger is taken through the small `CommRecordSource` protocol (``call_count`` and
``records``), which `deepshard.comm.CommsLogger` satisfies; the profiler does not import comm.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

from deepshard.interface.errors import DeepShardError

__all__ = [
    "GATHER_OPS",
    "PHASES",
    "REDUCTION_OPS",
    "CommRecordSource",
    "GatherWaitSource",
    "StepTimes",
    "WallClockTimers",
]

PHASES = ("forward", "backward", "reduce", "step")
"""The phases of the breakdown, in print order."""

TIMED_PHASES = ("forward", "backward", "step")
"""The phases timed as blocks (``reduce`` comes from the comms records)."""

REDUCTION_OPS = frozenset({"all_reduce", "reduce_scatter_tensor", "reduce_scatter", "reduce"})
"""Collective kinds (the comms logger's ``op``) that make up the "reduce" phase."""

GATHER_OPS = frozenset({"all_gather_into_tensor", "all_gather"})
"""Collective kinds whose latency makes up "gather (total)" (shown with a `GatherWaitSource`)."""


class CommRecord(Protocol):
    """One logged collective, as the timers read it."""

    @property
    def op(self) -> str:
        """The collective's kind, e.g. ``"reduce_scatter_tensor"``."""
        ...

    @property
    def latency_s(self) -> float:
        """Seconds the call took."""
        ...


class CommRecordSource(Protocol):
    """A comms logger: how many calls it logged, and its most recent per-call records."""

    @property
    def call_count(self) -> int:
        """Calls logged so far."""
        ...

    @property
    def records(self) -> Sequence[CommRecord]:
        """The most recent records, oldest first (possibly capped)."""
        ...


class GatherWaitSource(Protocol):
    """Running seconds a rank spent blocked on the all-gathers it needed (ZeRO stage 3)."""

    @property
    def exposed_gather_s(self) -> float:
        """Seconds blocked so far (never decreases)."""
        ...


@dataclass(frozen=True)
class StepTimes:
    """Seconds per phase of one optimizer step (or the sum over several).

    Attributes:
        forward_s: Forward passes.
        backward_s: Backward passes (including reductions overlapped with them).
        reduce_s: Latency of the step's reduction collectives, from the comms logger.
        step_s: Optimizer steps (unscale, norm, update, parameter gather).
        untimed_calls: Collectives logged in the step that had no record left to time (the
            logger's record cap was smaller than the calls of one step); ``reduce_s`` misses
            them.
        gather_s: Latency of the step's all-gathers, from the comms logger.
        gather_exposed_s: Seconds the rank was blocked waiting for all-gathers it needed.
    """

    forward_s: float = 0.0
    backward_s: float = 0.0
    reduce_s: float = 0.0
    step_s: float = 0.0
    untimed_calls: int = 0
    gather_s: float = 0.0
    gather_exposed_s: float = 0.0

    def __add__(self, other: StepTimes) -> StepTimes:
        return StepTimes(
            self.forward_s + other.forward_s,
            self.backward_s + other.backward_s,
            self.reduce_s + other.reduce_s,
            self.step_s + other.step_s,
            self.untimed_calls + other.untimed_calls,
            self.gather_s + other.gather_s,
            self.gather_exposed_s + other.gather_exposed_s,
        )

    def seconds(self, phase: str) -> float:
        """The seconds of one of `PHASES`."""
        value: float = getattr(self, f"{phase}_s")
        return value


class WallClockTimers:
    """Per-step phase times and their sums between two printed lines.

    Args:
        enabled: When false, timing does nothing (no clock, no synchronisation).
        synchronize: Waits for queued device work (at both ends of a timed block).
        comms: Where the "reduce" phase is read from; None reports 0.
        reduction_ops: The collective kinds counted as "reduce".
        gathers: The blocked-on-gather total (stage 3); when given, the line shows "gather
            (exposed)" and "gather (total)" (latency of the `GATHER_OPS` calls).
        clock: Monotonic seconds.
    """

    def __init__(
        self,
        *,
        enabled: bool,
        synchronize: Callable[[], None],
        comms: CommRecordSource | None = None,
        reduction_ops: frozenset[str] = REDUCTION_OPS,
        gathers: GatherWaitSource | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.enabled = enabled
        self._synchronize = synchronize
        self._comms = comms
        self._reduction_ops = reduction_ops
        self._gathers = gathers
        self._exposed_seen = gathers.exposed_gather_s if gathers is not None else 0.0
        self._clock = clock
        self._current = dict.fromkeys(TIMED_PHASES, 0.0)
        self._calls_seen = comms.call_count if comms is not None else 0
        self._window = StepTimes()
        self._window_steps = 0
        self.last_step: StepTimes | None = None
        """The times of the most recent ``end_step``."""

    @contextlib.contextmanager
    def time(self, phase: str) -> Iterator[None]:
        """Add the time spent in the ``with`` block to ``phase`` of the current step.

        Raises:
            DeepShardError: ``phase`` is not one of ``forward``, ``backward``, ``step``.
        """
        if phase not in self._current:
            raise DeepShardError(
                f"timers.time({phase!r}): timed phases are {', '.join(TIMED_PHASES)} "
                "(reduce is read from the comms logger)"
            )
        if not self.enabled:
            yield
            return
        self._synchronize()
        start = self._clock()
        try:
            yield
        finally:
            self._synchronize()
            self._current[phase] += self._clock() - start

    def _step_records(self) -> tuple[Sequence[CommRecord], int]:
        """The records of the calls logged since the last step, and how many had none left."""
        if self._comms is None:
            return (), 0
        calls = self._comms.call_count
        new, self._calls_seen = calls - self._calls_seen, calls
        if new <= 0:
            return (), 0
        records = self._comms.records
        kept = records[-new:] if new <= len(records) else records
        return kept, new - len(kept)

    def _step_exposed(self) -> float:
        if self._gathers is None:
            return 0.0
        total = self._gathers.exposed_gather_s
        exposed, self._exposed_seen = total - self._exposed_seen, total
        return exposed

    def end_step(self) -> StepTimes:
        """Close the current optimizer step: its phase times, added to the window.

        Returns:
            The step's times (all zero when disabled).
        """
        if not self.enabled:
            return StepTimes()
        records, untimed = self._step_records()
        step = StepTimes(
            forward_s=self._current["forward"],
            backward_s=self._current["backward"],
            reduce_s=sum(r.latency_s for r in records if r.op in self._reduction_ops),
            step_s=self._current["step"],
            untimed_calls=untimed,
            gather_s=sum(r.latency_s for r in records if r.op in GATHER_OPS),
            gather_exposed_s=self._step_exposed(),
        )
        self._current = dict.fromkeys(TIMED_PHASES, 0.0)
        self._window = self._window + step
        self._window_steps += 1
        self.last_step = step
        return step

    @property
    def window(self) -> StepTimes:
        """The summed times of the steps ended since the last ``reset``."""
        return self._window

    def line(self, steps: int | None = None) -> str:
        """Mean milliseconds per optimizer step of each phase over the window.

        Args:
            steps: Divide by this many steps; by default the steps ended in the window.
        """
        count = max(steps if steps is not None else self._window_steps, 1)
        window = self._window
        parts = [f"{p} {1e3 * window.seconds(p) / count:.2f}" for p in PHASES]
        if self._gathers is not None:
            parts.append(f"gather (exposed) {1e3 * window.gather_exposed_s / count:.2f}")
            parts.append(f"gather (total) {1e3 * window.gather_s / count:.2f}")
        line = "time per step (ms): " + " | ".join(parts)
        if window.untimed_calls:
            missing = "reduce and gather miss" if self._gathers is not None else "reduce misses"
            line += (
                f" ({missing} {window.untimed_calls} untimed calls: raise the comms logger's "
                "max_records above the calls of one step)"
            )
        return line

    def reset(self) -> None:
        """Start a new window (the current step's running times are kept)."""
        self._window = StepTimes()
        self._window_steps = 0
