"""What the engine tells the user: progress lines, the wall-clock breakdown, memory and comms.

Every ``steps_per_print`` optimizer steps, rank 0 (every rank with ``DEEPSHARD_LOG_ALL_RANKS=1``)
logs one progress line (logger ``deepshard.engine``, level INFO, shown without any logging set-up:
see ``_logging``): the step, the mean loss of that step's micro-batches on that rank, the learning
rates, the global gradient norm, the loss scale and the samples per second since the previous
line. With ``wall_clock_breakdown`` a second line gives the mean time per step of each phase:
forward, backward (which includes the reductions ZeRO overlaps with it), reduce (the time the
reduction collectives of each step took, from the comms logger's records of that step) and step
(norm, update, parameter gather); at ZeRO stage 3 also "gather (exposed)", the time the rank was
blocked waiting for parameter all-gathers its hooks needed (`ShardedModule.gather_waits`), and
"gather (total)", those all-gathers' latency from the comms records, so the share prefetch hid is
visible; the timers are a `deepshard.profiler.WallClockTimers`. With
``memory_breakdown`` a line gives this rank's tensor bytes, and with ``comms_logger.enabled``
the logger's summary table follows.

Nothing is synchronised or read back from the device except when a line is printed.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from deepshard.comm import CommsLogger
from deepshard.profiler import WallClockTimers
from deepshard.zero import Stage3Optimizer, ZeroOptimizer

__all__ = [
    "ProgressReporter",
    "TensorBytes",
    "tensor_bytes",
]

_log = logging.getLogger("deepshard.engine")


def _format_bytes(count: int) -> str:
    value = float(count)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.1f} {unit}" if unit != "B" else f"{count} B"
        value /= 1024
    raise AssertionError("unreachable")


@dataclass(frozen=True)
class TensorBytes:
    """Bytes of training tensors this rank holds (device allocations, not process memory).

    Attributes:
        parameters: The model's parameters (each counted once).
        gradients: Gradient storage: ZeRO's buffers and any ``.grad`` outside ZeRO.
        master_weights: ZeRO's fp32 master partition.
        optimizer_state: The inner optimizer's state tensors.
    """

    parameters: int
    gradients: int
    master_weights: int
    optimizer_state: int

    @property
    def total(self) -> int:
        """The sum of the four."""
        return self.parameters + self.gradients + self.master_weights + self.optimizer_state

    def line(self) -> str:
        """One human-readable line."""
        return (
            f"tensor bytes: parameters {_format_bytes(self.parameters)} | gradients "
            f"{_format_bytes(self.gradients)} | master weights "
            f"{_format_bytes(self.master_weights)} | optimizer state "
            f"{_format_bytes(self.optimizer_state)} | total {_format_bytes(self.total)}"
        )


def tensor_bytes(module: torch.nn.Module, zero: ZeroOptimizer | None) -> TensorBytes:
    """Counts this rank's parameter, gradient, master and optimizer-state bytes.

    Args:
        module: The model.
        zero: Its ZeRO optimizer, or None (no optimizer).

    Returns:
        The counts.
    """
    params = {id(p): p for p in module.parameters()}.values()
    stray = sum(p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None)
    # stage 3: gathered parameters are counted by their views; the partitions come on top
    partitions = zero.sharded.partition_bytes() if isinstance(zero, Stage3Optimizer) else 0
    return TensorBytes(
        parameters=partitions + sum(p.numel() * p.element_size() for p in params),
        gradients=stray + (zero.gradient_bytes() if zero is not None else 0),
        master_weights=zero.master_bytes() if zero is not None else 0,
        optimizer_state=zero.optimizer_state_bytes() if zero is not None else 0,
    )


class ProgressReporter:
    """Collects each step's loss and prints the lines every ``steps_per_print`` steps on rank 0.

    Args:
        steps_per_print: Print period in optimizer steps; None prints nothing.
        rank: This process's global rank (only rank 0 prints).
        train_batch_size: Samples per optimizer step, for the throughput.
        timers: The wall-clock breakdown (printed when enabled).
        comms_logger: Whose summary is printed when ``print_comms``.
        print_comms: ``comms_logger.enabled``.
        memory: Returns the tensor bytes when ``memory_breakdown`` is on, else None.
        all_ranks: Every rank prints its own lines (``DEEPSHARD_LOG_ALL_RANKS=1``), not only
            rank 0.
        clock: Monotonic seconds.
    """

    def __init__(
        self,
        *,
        steps_per_print: int | None,
        rank: int,
        train_batch_size: int,
        timers: WallClockTimers,
        comms_logger: CommsLogger | None,
        print_comms: bool,
        memory: Callable[[], TensorBytes] | None,
        all_ranks: bool = False,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.steps_per_print = steps_per_print
        self.rank = rank
        self.prints = rank == 0 or all_ranks
        self.train_batch_size = train_batch_size
        self.timers = timers
        self._comms = comms_logger if print_comms else None
        self._memory = memory
        self._clock = clock
        self._window_start = clock()
        self._loss_sum: torch.Tensor | None = None
        self._loss_count = 0

    def add_loss(self, loss: torch.Tensor) -> None:
        """Take one micro-batch's (unscaled) loss; it stays on the device until printed."""
        value = loss.detach().float().mean()
        self._loss_sum = value if self._loss_sum is None else self._loss_sum + value
        self._loss_count += 1

    def end_step(
        self, *, step: int, lrs: list[float], grad_norm: float | None, loss_scale: float
    ) -> None:
        """Close one optimizer step; print when ``step`` is a multiple of the period.

        Args:
            step: The global step just finished (1 for the first).
            lrs: The learning rate of each param group.
            grad_norm: The global gradient norm, None when not computed.
            loss_scale: The loss scale the step used.
        """
        loss_sum, count = self._loss_sum, self._loss_count
        self._loss_sum, self._loss_count = None, 0
        period = self.steps_per_print
        if period is None or step % period:
            return
        now = self._clock()
        elapsed, self._window_start = now - self._window_start, now
        if self.prints:
            loss = "n/a" if loss_sum is None else f"{loss_sum.item() / count:.6g}"
            norm = "n/a" if grad_norm is None else f"{grad_norm:.6g}"
            rate = period * self.train_batch_size / elapsed if elapsed > 0 else float("inf")
            lr = ", ".join(f"{value:.6g}" for value in lrs)
            _log.info(
                "step %d | loss %s | lr [%s] | grad norm %s | loss scale %g | samples/s %.2f",
                *(step, loss, lr, norm, loss_scale, rate),
            )
            self._print_details(period)
        self.timers.reset()

    def _print_details(self, period: int) -> None:
        if self.timers.enabled:
            _log.info("%s", self.timers.line(period))
        if self._memory is not None:
            _log.info("%s", self._memory().line())
        if self._comms is not None:
            _log.info("communication summary:\n%s", self._comms.summary())
