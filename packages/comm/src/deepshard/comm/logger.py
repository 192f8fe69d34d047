"""The comms logger: size, latency and bandwidth of each collective, and a summary table.

A `CommsLogger` is an ordinary object passed to the collectives (`logger=`); there is no
global instance. Per call it records the op, the log name (the op's own name unless the caller gave
one), the message bytes, and the latency of *that call alone*: the clock starts when the call is
issued and stops when it completes. For an async call on the host (gloo) the stop is taken by the
backend's completion callback, so work the caller does before `wait()` is not counted. On an
accelerator the device is synchronized before the clock starts and before it stops (for an async
call, at the first `wait()`: accelerator futures complete when kernels are queued, so they cannot
date the completion), so queued kernels are not charged to the collective. Bandwidths follow
nccl-tests (see `deepshard.comm._bandwidth`).

When the config says `enabled: false` the logger does nothing at all: no clock, no synchronize,
no record. The summary aggregates every logged call exactly; the per-call records kept for
inspection are bounded (`max_records`) so a long run does not grow without limit.
"""

from __future__ import annotations

import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TextIO

import torch

from deepshard.comm._bandwidth import bandwidth
from deepshard.comm._summary import CallStats, format_bytes, format_table
from deepshard.comm.watchdog import CommWatchdog
from deepshard.interface.config.comms_logger import CommsLoggerConfig
from deepshard.interface.errors import ConfigError

__all__ = ["CommRecord", "CommTiming", "CommsLogger"]


@dataclass(frozen=True)
class CommRecord:
    """One logged call."""

    op: str
    """The collective, e.g. `"all_reduce"`."""
    log_name: str
    """The caller's name for the call; the op's name when none was given."""
    msg_bytes: int
    """Bytes counted for the call (nccl-tests conventions)."""
    latency_s: float
    """Seconds from issue to completion of this call alone."""
    world_size: int
    """Ranks in the group the call ran on."""
    algbw: float
    """Algorithmic bandwidth in bytes per second."""
    busbw: float
    """Bus bandwidth in bytes per second."""
    note: str | None = None
    """Set when the bandwidth used a fallback factor (unknown op)."""


@dataclass(frozen=True)
class CommTiming:
    """A call whose clock is running; hand it back to `CommsLogger.stop`."""

    op: str
    log_name: str
    msg_bytes: int
    world_size: int
    device: torch.device | None
    start_s: float
    group_rank: int | None = None


def _default_synchronize(device: torch.device | None) -> None:
    """Wait for queued work on `device`'s accelerator; CPU work is already done."""
    if device is None or device.type == "cpu":
        return
    from deepshard.accelerators import get_accelerator

    get_accelerator(device.type).synchronize(device)


def _caller_name() -> str:
    """Name of the innermost calling function outside `deepshard.comm`."""
    frame = sys._getframe(1)
    while frame.f_back is not None and frame.f_globals.get("__name__", "").startswith(
        "deepshard.comm"
    ):
        frame = frame.f_back
    return frame.f_code.co_name


class CommsLogger:
    """Records collectives passed `logger=self` and summarizes them per op and message size.

    Args:
        config: The `comms_logger` config section; the defaults (disabled) when `None`.
        synchronize: Called with the tensor's device before the clock starts and stops. Defaults
            to the device's accelerator synchronize (a no-op on CPU).
        clock: Monotonic seconds; `time.perf_counter` by default.
        rank: This process's rank, which decides who prints verbose lines (rank 0). When
            `None`, each call's rank within the group it ran on decides (rank 0 of every group
            prints that group's calls); `verbose` calls with neither are refused.
        stream: Where verbose lines go; `sys.stdout` (at print time) when `None`.
        max_records: Most recent per-call records kept in `records`. The summary counts
            every call regardless.
        watchdog: A comms watchdog for every collective this logger is passed to (code that
            threads a logger, such as ZeRO, gets the watchdog with it), enabled or not.

    Raises:
        ConfigError: If `max_records` is not positive.
    """

    def __init__(
        self,
        config: CommsLoggerConfig | None = None,
        *,
        synchronize: Callable[[torch.device | None], None] | None = None,
        clock: Callable[[], float] = time.perf_counter,
        rank: int | None = None,
        stream: TextIO | None = None,
        max_records: int = 100_000,
        watchdog: CommWatchdog | None = None,
    ) -> None:
        if max_records < 1:
            raise ConfigError(f"CommsLogger max_records must be >= 1, got {max_records}.")
        self._config = config if config is not None else CommsLoggerConfig()
        self._synchronize = synchronize if synchronize is not None else _default_synchronize
        self._clock = clock
        self._rank = rank
        self._stream = stream
        self._records: deque[CommRecord] = deque(maxlen=max_records)
        self._stats: dict[tuple[str, str, int, int], CallStats] = {}
        self._watchdog = watchdog

    @property
    def watchdog(self) -> CommWatchdog | None:
        """The comms watchdog the collectives use when they get this logger and no watchdog."""
        return self._watchdog

    @property
    def config(self) -> CommsLoggerConfig:
        """The config section this logger follows."""
        return self._config

    @property
    def enabled(self) -> bool:
        """Whether anything is recorded at all."""
        return self._config.enabled

    @property
    def records(self) -> tuple[CommRecord, ...]:
        """The most recent per-call records, oldest first."""
        return tuple(self._records)

    @property
    def call_count(self) -> int:
        """Calls logged since construction or the last `reset`."""
        return sum(stats.count for stats in self._stats.values())

    def wants(self, op: str, log_name: str | None = None) -> bool:
        """Whether a call of `op` (named `log_name`) would be logged.

        With `prof_all: false` a call is logged when its op or its log name is in `prof_ops`.
        """
        cfg = self._config
        if not cfg.enabled:
            return False
        return (
            cfg.prof_all
            or op in cfg.prof_ops
            or (log_name is not None and log_name in cfg.prof_ops)
        )

    def start(
        self,
        op: str,
        *,
        msg_bytes: int,
        world_size: int,
        log_name: str | None = None,
        device: torch.device | None = None,
        group_rank: int | None = None,
    ) -> CommTiming | None:
        """Start the clock for one call about to be issued.

        Args:
            op: The collective's name.
            msg_bytes: Bytes counted for the call.
            world_size: Ranks in the group.
            log_name: The caller's name for the call; defaults to `op`.
            device: The tensors' device, synchronized before the clock starts.
            group_rank: This process's rank in the group the call runs on (decides, with
                `verbose` and no logger `rank`, whether the call is printed).

        Returns:
            The running timing to pass to `stop`, or `None` when this call is not logged
            (then nothing was synchronized or timed).

        Raises:
            ConfigError: `verbose` is on and neither the logger nor the call gives a rank.
        """
        if not self.wants(op, log_name):
            return None
        self._check_print_rank(group_rank)
        name = log_name if log_name is not None else op
        if self._config.debug:
            name = f"{name} | {_caller_name()}"
        self._synchronize(device)
        return CommTiming(op, name, msg_bytes, world_size, device, self._clock(), group_rank)

    @property
    def clock(self) -> Callable[[], float]:
        """The clock latencies are measured with (read it for `stop(end_s=...)`)."""
        return self._clock

    def stop(self, timing: CommTiming, *, end_s: float | None = None) -> CommRecord:
        """Stop the clock of a completed call and record it.

        Args:
            timing: What `start` returned for the call.
            end_s: The `clock` reading when the call completed, if it was taken already (an
                async call's completion callback); then nothing is synchronized. `None` reads
                the clock now, after synchronizing the device.

        Returns:
            The new record.
        """
        if end_s is None:
            self._synchronize(timing.device)
            end_s = self._clock()
        latency_s = end_s - timing.start_s
        return self._add(
            timing.op,
            timing.log_name,
            timing.msg_bytes,
            latency_s,
            timing.world_size,
            timing.group_rank,
        )

    def record(
        self,
        op: str,
        *,
        msg_bytes: int,
        latency_s: float,
        world_size: int,
        log_name: str | None = None,
        group_rank: int | None = None,
    ) -> CommRecord | None:
        """Record a call timed elsewhere (e.g. a custom collective); any op name is accepted.

        Args:
            op: The collective's name.
            msg_bytes: Bytes counted for the call.
            latency_s: Its latency in seconds.
            world_size: Ranks in the group.
            log_name: The caller's name for the call; defaults to `op`.
            group_rank: This process's rank in the call's group (see `start`).

        Returns:
            The record, or `None` when the config filters this call out.

        Raises:
            ConfigError: `verbose` is on and neither the logger nor the call gives a rank.
        """
        if not self.wants(op, log_name):
            return None
        self._check_print_rank(group_rank)
        name = log_name if log_name is not None else op
        return self._add(op, name, msg_bytes, latency_s, world_size, group_rank)

    def _check_print_rank(self, group_rank: int | None) -> None:
        if self._config.verbose and self._rank is None and group_rank is None:
            raise ConfigError(
                "comms_logger.verbose prints on rank 0 only, but this call names no rank: pass "
                "rank= to CommsLogger (or group_rank= to start/record)."
            )

    def _add(
        self,
        op: str,
        log_name: str,
        msg_bytes: int,
        latency_s: float,
        world_size: int,
        group_rank: int | None,
    ) -> CommRecord:
        bw = bandwidth(op, msg_bytes, latency_s, world_size)
        rec = CommRecord(
            op, log_name, msg_bytes, latency_s, world_size, bw.algbw, bw.busbw, bw.note
        )
        self._records.append(rec)
        # Groups of different sizes have different bus-bandwidth factors: separate rows.
        key = (op, log_name, msg_bytes, world_size)
        self._stats.setdefault(key, CallStats()).add(latency_s, bw.algbw, bw.busbw, bw.note)
        rank = self._rank if self._rank is not None else group_rank
        if self._config.verbose and rank == 0:
            print(_verbose_line(rec), file=self._stream or sys.stdout, flush=True)
        return rec

    def summary(self) -> str:
        """The table of logged calls per op, log name, message size and group size.

        Columns: count, total and average latency, and the average algorithmic and bus
        bandwidth of the calls in the row.
        """
        return format_table(self._stats)

    def print_summary(self, file: TextIO | None = None) -> None:
        """Print `summary` to `file` (standard output when `None`)."""
        print(self.summary(), file=file or sys.stdout, flush=True)

    def maybe_print_summary(
        self, step: int, steps_per_print: int, file: TextIO | None = None
    ) -> bool:
        """Print the summary when `step` is a positive multiple of `steps_per_print`.

        Every rank that calls this prints; call it on the ranks that should (usually rank 0).

        Returns:
            Whether the summary was printed.

        Raises:
            ConfigError: If `steps_per_print` is not positive.
        """
        if steps_per_print < 1:
            raise ConfigError(f"steps_per_print must be >= 1, got {steps_per_print}.")
        if step <= 0 or step % steps_per_print != 0:
            return False
        self.print_summary(file)
        return True

    def reset(self) -> None:
        """Forget every record and the summary totals."""
        self._records.clear()
        self._stats.clear()


def _verbose_line(rec: CommRecord) -> str:
    gb = 1e9
    line = (
        f"[comms] {rec.log_name}: op={rec.op} size={format_bytes(rec.msg_bytes)} "
        f"latency={rec.latency_s * 1e3:.3f} ms algbw={rec.algbw / gb:.4g} GB/s "
        f"busbw={rec.busbw / gb:.4g} GB/s"
    )
    return f"{line} ({rec.note})" if rec.note else line
