"""`OneCycle` and `LRRangeTest`: DeepSpeed's cyclic schedules (Smith, arXiv:1803.09820).

**OneCycle.** One cycle of ``T = first + second`` positions, then a decay phase. At position
``i`` the batch count is ``b = i + 1`` and its offset in the cycle ``c = b mod T``; the cycle
scale is ``c / first`` on the way up (``c <= first``) and ``(T - c) / second`` on the way down.
With a stair count ``k > 0`` for that half, the scale is floored to ``floor(scale * k) / k``:
the value holds for ``size / k`` positions and then jumps. The lr is
``min_lr + (max_lr - min_lr) * scale``; momentum moves the other way,
``max_mom - (max_mom - min_mom) * scale``. From ``i = T`` on, with ``d = i - T + 1``, the lr is
``min_lr / (1 + decay_lr_rate * d / decay_step_size)`` and the momentum
``max_mom * (1 + decay_mom_rate * d / decay_step_size)`` (DeepSpeed multiplies: a positive
``decay_mom_rate`` *raises* momentum); ``decay_step_size = 0`` holds ``min_lr`` / ``max_mom``.
Before the first step (``i = -1``) the lr is ``min_lr`` and the momentum ``min_mom``, which is
what DeepSpeed writes at construction (the cycle formula would give ``max_mom`` there).

Momentum goes into ``betas[0]`` for Adam-like param groups (``betas[1]`` is kept) and into
``momentum`` for SGD-like ones; an optimizer with neither is left alone, with a warning.
``get_mom()`` answers in the same form: ``(beta1, beta2)`` pairs, as DeepSpeed's does, or the
SGD momentum values.

**LRRangeTest.** ``min_lr * (1 + step_rate * (i + 1) / step_size)``, with the quotient floored
when ``lr_range_test_staircase`` is set.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from deepshard.optimizers._schedule_base import (
    BatchSchedule,
    ParamGroupOwner,
    check_bool,
    check_int,
    check_number,
    check_per_group,
    refuse,
    write_value,
)

__all__ = ["CycleShape", "LRRangeTest", "OneCycle"]


@dataclass(frozen=True)
class CycleShape:
    """The shape of one 1Cycle: the lengths of its halves and their stair counts.

    Attributes:
        first_step_size: Positions on the way up, > 0.
        second_step_size: Positions on the way down, >= 0.
        first_stair_count: Stairs on the way up; 0 moves every position.
        second_stair_count: Stairs on the way down; 0 moves every position.
    """

    first_step_size: float
    second_step_size: float
    first_stair_count: int
    second_stair_count: int

    @property
    def total_size(self) -> float:
        """Positions in the whole cycle."""
        return self.first_step_size + self.second_step_size

    def scale(self, iteration: int) -> float:
        """How far from the low end the cycle is at `iteration`: 0 at the ends, 1 at the peak."""
        offset = (iteration + 1) % self.total_size
        if offset <= self.first_step_size:
            into, size, stairs = offset, self.first_step_size, self.first_stair_count
        else:
            into = self.total_size - offset
            size, stairs = self.second_step_size, self.second_stair_count
        if stairs > 0:
            # Floor the stair from the batch offset itself, so an exact stair edge (the peak
            # included) never drops a stair through rounding of a float fraction.
            return math.floor(into * stairs / size) / stairs
        return into / size


def _cycle_shape(
    first_step_size: object,
    second_step_size: object,
    first_stair_count: object,
    second_stair_count: object,
) -> CycleShape:
    first = check_number("cycle_first_step_size", first_step_size, minimum=0)
    if first == 0:
        refuse("cycle_first_step_size", "must be positive (positions on the way up), got 0")
    if second_step_size is None:
        second = first
    else:
        second = check_number("cycle_second_step_size", second_step_size, minimum=0)
    first_stairs = check_int("cycle_first_stair_count", first_stair_count, minimum=0)
    if second_stair_count is None:
        second_stairs = first_stairs
    else:
        second_stairs = check_int("cycle_second_stair_count", second_stair_count, minimum=0)
    return CycleShape(first, second, first_stairs, second_stairs)


def _momentum_key(optimizer: ParamGroupOwner) -> str | None:
    """Where the optimizer keeps momentum: ``"betas"`` (Adam-like), ``"momentum"`` or neither."""
    groups = optimizer.param_groups
    for key in ("betas", "momentum"):
        if groups and all(key in group for group in groups):
            return key
    return None


def _write_momentum(group: dict[str, Any], key: str, value: float) -> None:
    if key == "momentum":
        write_value(group, key, value)
        return
    betas = tuple(group["betas"])
    if isinstance(betas[0], torch.Tensor):
        betas[0].fill_(value)
    else:
        group["betas"] = (value, *betas[1:])


class OneCycle(BatchSchedule):
    """One lr cycle from ``cycle_min_lr`` up to ``cycle_max_lr`` and back, then a decay phase.

    Args:
        optimizer: The optimizer (or anything with ``param_groups``) whose lr is set.
        cycle_min_lr: Low end of the lr cycle, a number or one per param group.
        cycle_max_lr: High end of the lr cycle, a number or one per param group.
        decay_lr_rate: lr decay rate after the cycle. Default 0 (hold ``cycle_min_lr``).
        cycle_first_step_size: Positions on the way up. Default 2000.
        cycle_second_step_size: Positions on the way down. Default: ``cycle_first_step_size``.
        cycle_first_stair_count: Stairs on the way up; 0 (default) for a smooth ramp.
        cycle_second_stair_count: Stairs on the way down. Default: ``cycle_first_stair_count``.
        decay_step_size: Positions per decay interval after the cycle; 0 (default) disables
            the decay.
        cycle_momentum: Cycle momentum inversely to the lr. Default True.
        cycle_min_mom: Low end of the momentum cycle, a number or one per group. Default 0.8.
        cycle_max_mom: High end of the momentum cycle, a number or one per group. Default 0.9.
        decay_mom_rate: Momentum rate after the cycle (a factor ``1 + rate * d / size``).
        last_batch_iteration: Position to start at; -1 starts from the beginning.

    Raises:
        ConfigError: On a bad value, naming the parameter.
    """

    def __init__(
        self,
        optimizer: ParamGroupOwner,
        cycle_min_lr: float | Sequence[float],
        cycle_max_lr: float | Sequence[float],
        decay_lr_rate: float = 0.0,
        cycle_first_step_size: float = 2000,
        cycle_second_step_size: float | None = None,
        cycle_first_stair_count: int = 0,
        cycle_second_stair_count: int | None = None,
        decay_step_size: float = 0,
        cycle_momentum: bool = True,
        cycle_min_mom: float | Sequence[float] = 0.8,
        cycle_max_mom: float | Sequence[float] = 0.9,
        decay_mom_rate: float = 0.0,
        last_batch_iteration: int = -1,
    ) -> None:
        super().__init__(optimizer, last_batch_iteration)
        self.shape = _cycle_shape(
            cycle_first_step_size,
            cycle_second_step_size,
            cycle_first_stair_count,
            cycle_second_stair_count,
        )
        count = self.group_count
        self.min_lrs = check_per_group("cycle_min_lr", cycle_min_lr, count, minimum=0)
        self.max_lrs = check_per_group("cycle_max_lr", cycle_max_lr, count, minimum=0)
        self.decay_lr_rate = check_number("decay_lr_rate", decay_lr_rate, minimum=0)
        self.decay_step_size = check_number("decay_step_size", decay_step_size, minimum=0)
        self.min_moms = check_per_group("cycle_min_mom", cycle_min_mom, count, minimum=0, maximum=1)
        self.max_moms = check_per_group("cycle_max_mom", cycle_max_mom, count, minimum=0, maximum=1)
        self.decay_mom_rate = check_number("decay_mom_rate", decay_mom_rate)
        self.cycle_momentum = check_bool("cycle_momentum", cycle_momentum)
        self._momentum_key = _momentum_key(optimizer) if self.cycle_momentum else None
        if self.cycle_momentum and self._momentum_key is None:
            warnings.warn(
                f"OneCycle leaves momentum alone: {type(optimizer).__name__} param groups have "
                "neither 'betas' nor 'momentum'; set cycle_momentum to false to silence this",
                stacklevel=2,
            )
            self.cycle_momentum = False
        self._apply()

    def _decay_position(self, iteration: int) -> float | None:
        """Decay intervals done at `iteration`, or `None` inside the cycle or without decay."""
        if iteration < self.shape.total_size or self.decay_step_size == 0:
            return None
        return (iteration - self.shape.total_size + 1) / self.decay_step_size

    def _lrs_at(self, iteration: int) -> list[float]:
        if iteration >= self.shape.total_size:
            intervals = self._decay_position(iteration)
            if intervals is None:
                return list(self.min_lrs)
            return [low / (1.0 + self.decay_lr_rate * intervals) for low in self.min_lrs]
        scale = self.shape.scale(iteration)
        return [
            low + (high - low) * scale for low, high in zip(self.min_lrs, self.max_lrs, strict=True)
        ]

    def _moms_at(self, iteration: int) -> list[float]:
        if iteration < 0:
            return list(self.min_moms)
        if iteration >= self.shape.total_size:
            intervals = self._decay_position(iteration)
            if intervals is None:
                return list(self.max_moms)
            return [high * (1.0 + self.decay_mom_rate * intervals) for high in self.max_moms]
        scale = self.shape.scale(iteration)
        return [
            high - (high - low) * scale
            for low, high in zip(self.min_moms, self.max_moms, strict=True)
        ]

    def get_mom(self) -> list[tuple[float, float]] | list[float] | None:
        """Each group's momentum at the current position, in the form the group keeps it.

        Returns:
            ``(beta1, beta2)`` per group for Adam-like groups, as DeepSpeed's OneCycle returns
            them (``beta2`` is the group's own, which DeepSpeed would have replaced with 0.99);
            the ``momentum`` value per group for SGD-like ones; `None` when momentum is not
            cycled.
        """
        if not self.cycle_momentum:
            return None
        moms = self._moms_at(self.last_batch_iteration)
        if self._momentum_key != "betas":
            return moms
        groups = self.optimizer.param_groups
        return [(m, float(g["betas"][1])) for m, g in zip(moms, groups, strict=True)]

    def _apply(self) -> None:
        super()._apply()
        key = self._momentum_key
        if key is None:
            return
        moms = self._moms_at(self.last_batch_iteration)
        for group, value in zip(self.optimizer.param_groups, moms, strict=True):
            _write_momentum(group, key, value)


class LRRangeTest(BatchSchedule):
    """Grows each group's lr from ``lr_range_test_min_lr``, to find the largest lr that trains.

    Args:
        optimizer: The optimizer (or anything with ``param_groups``) whose lr is set.
        lr_range_test_min_lr: Start lr, a number or one per param group. Default 0.001.
        lr_range_test_step_size: Positions per increase interval. Default 2000.
        lr_range_test_step_rate: Increase per interval, as a multiple of the start lr.
            Default 1.0.
        lr_range_test_staircase: Grow in whole intervals instead of every position. Default
            False.
        last_batch_iteration: Position to start at; -1 starts from the beginning.

    Raises:
        ConfigError: On a bad value, naming the parameter.
    """

    def __init__(
        self,
        optimizer: ParamGroupOwner,
        lr_range_test_min_lr: float | Sequence[float] = 1e-3,
        lr_range_test_step_size: int = 2000,
        lr_range_test_step_rate: float = 1.0,
        lr_range_test_staircase: bool = False,
        last_batch_iteration: int = -1,
    ) -> None:
        super().__init__(optimizer, last_batch_iteration)
        self.min_lrs = check_per_group(
            "lr_range_test_min_lr", lr_range_test_min_lr, self.group_count, minimum=0
        )
        self.step_size = check_int("lr_range_test_step_size", lr_range_test_step_size, minimum=1)
        self.step_rate = check_number("lr_range_test_step_rate", lr_range_test_step_rate, minimum=0)
        self.staircase = check_bool("lr_range_test_staircase", lr_range_test_staircase)
        self._apply()

    def _lrs_at(self, iteration: int) -> list[float]:
        batches = iteration + 1
        intervals = batches // self.step_size if self.staircase else batches / self.step_size
        growth = 1.0 + self.step_rate * intervals
        return [low * growth for low in self.min_lrs]
