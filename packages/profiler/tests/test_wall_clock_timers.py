"""`WallClockTimers`: phase times per step, "reduce" from the step's own comms records (by
collective kind, not log name), and a visible count of calls beyond the logger's record cap."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import pytest

from deepshard.interface.errors import DeepShardError
from deepshard.profiler import WallClockTimers


@dataclass(frozen=True)
class _Record:
    op: str
    latency_s: float


class _Logger:
    """Keeps the newest ``cap`` records and counts every call, like `CommsLogger`."""

    def __init__(self, cap: int) -> None:
        self._records: deque[_Record] = deque(maxlen=cap)
        self.call_count = 0

    @property
    def records(self) -> tuple[_Record, ...]:
        return tuple(self._records)

    def log(self, op: str, latency_s: float) -> None:
        self._records.append(_Record(op, latency_s))
        self.call_count += 1


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _timers(logger: _Logger, clock: _Clock, syncs: list[int]) -> WallClockTimers:
    return WallClockTimers(
        enabled=True, synchronize=lambda: syncs.append(1), comms=logger, clock=clock
    )


def test_each_step_gets_its_own_phase_times_and_reductions() -> None:
    logger, clock, syncs = _Logger(cap=100), _Clock(), []
    timers = _timers(logger, clock, syncs)
    logger.log("all_reduce", 5.0)  # before the first step began: still that step's
    for step in range(2):
        with timers.time("forward"):
            clock.now += 1.0
        with timers.time("backward"):
            clock.now += 2.0
            logger.log("reduce_scatter_tensor", 0.5)
        with timers.time("step"):
            clock.now += 0.25
            logger.log("all_gather_into_tensor", 9.0)  # not a reduction
        times = timers.end_step()
        assert (times.forward_s, times.backward_s, times.step_s) == (1.0, 2.0, 0.25)
        assert times.reduce_s == (5.5 if step == 0 else 0.5)
    assert len(syncs) == 2 * 3 * 2
    assert timers.line() == (
        "time per step (ms): forward 1000.00 | backward 2000.00 | reduce 3000.00 | step 250.00"
    )
    timers.reset()
    assert timers.window.forward_s == 0.0


def test_calls_beyond_the_record_cap_are_reported_not_dropped() -> None:
    logger, clock = _Logger(cap=3), _Clock()
    timers = _timers(logger, clock, [])
    for _ in range(5):
        logger.log("all_reduce", 1.0)
    times = timers.end_step()
    assert (times.reduce_s, times.untimed_calls) == (3.0, 2)
    assert "misses 2 untimed calls" in timers.line()


def test_disabled_timers_do_nothing_and_bad_phases_are_refused() -> None:
    syncs: list[int] = []
    timers = WallClockTimers(enabled=False, synchronize=lambda: syncs.append(1))
    with timers.time("forward"):
        pass
    assert timers.end_step().forward_s == 0.0 and not syncs
    with (
        pytest.raises(DeepShardError, match="reduce is read from the comms logger"),
        timers.time("reduce"),
    ):
        pass


@dataclass
class _Waits:
    """A stage-3 module's running blocked-on-gather seconds."""

    exposed_gather_s: float = 0.0


def test_stage3_lines_show_exposed_and_total_gather_time_per_step() -> None:
    logger, clock, waits = _Logger(cap=100), _Clock(), _Waits(exposed_gather_s=7.0)
    timers = WallClockTimers(
        enabled=True, synchronize=lambda: None, comms=logger, gathers=waits, clock=clock
    )
    # seconds blocked before the timers existed are not any step's
    for exposed, gathers in ((0.5, (1.0, 2.0)), (0.25, (3.0,))):
        with timers.time("forward"):
            clock.now += 1.0
            waits.exposed_gather_s += exposed
            for latency in gathers:
                logger.log("all_gather_into_tensor", latency)
            logger.log("reduce_scatter_tensor", 4.0)
        times = timers.end_step()
        assert times.gather_exposed_s == exposed and times.gather_s == sum(gathers)
        assert times.reduce_s == 4.0
    assert timers.line() == (
        "time per step (ms): forward 1000.00 | backward 0.00 | reduce 4000.00 | step 0.00 | "
        "gather (exposed) 375.00 | gather (total) 3000.00"
    )
    assert "gather" not in _timers(logger, clock, []).line()  # stages 0-2: no gather figures
