"""Warm-up schedules: `WarmupLR`, `WarmupDecayLR` and `WarmupCosineLR`, DeepSpeed's sequences.

All three ramp over ``n = max(2, warmup_num_steps)`` positions (DeepSpeed lifts 1 to 2 so the
log ramp never divides by ``log 1``). The ramp fraction at position ``i`` is

* ``log(i + 1) / log(n)`` for ``warmup_type="log"``, or ``i / n`` for ``"linear"``, while
  ``i < n``; 1 from ``i = n`` on.

`WarmupLR` moves each group from ``warmup_min_lr`` to ``warmup_max_lr`` by that fraction and
stays there. `WarmupDecayLR` then falls linearly, ``(T - i) / max(1, T - n)`` of the way, to 0
at ``i = T = total_num_steps``. `WarmupCosineLR` scales each group's own optimizer lr by a
ratio: ``warmup_min_ratio`` ramped to 1, then a half cosine down to ``cos_min_ratio`` over
``max(1, T - n)`` positions (the first post-warm-up position is already one step into it),
held at ``cos_min_ratio`` afterwards.

The value before the first step (position -1) is DeepSpeed's: ``warmup_min_lr`` for the first
two, and 0 for `WarmupCosineLR` (its first optimizer step runs with lr 0).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Literal

from deepshard.optimizers._schedule_base import (
    BatchSchedule,
    ParamGroupOwner,
    check_int,
    check_number,
    check_per_group,
    group_lrs,
    refuse,
    restore_base_lrs,
)

__all__ = ["WarmupCosineLR", "WarmupDecayLR", "WarmupLR", "warmup_fraction"]

WarmupType = Literal["log", "linear"]
_WARMUP_TYPES: tuple[str, ...] = ("log", "linear")


def warmup_fraction(iteration: int, ramp_steps: int, warmup_type: str) -> float:
    """How far the warm-up has come at `iteration`: 0 up to position 0, 1 from `ramp_steps` on.

    Args:
        iteration: The schedule position (``last_batch_iteration``).
        ramp_steps: Positions the ramp takes, at least 2.
        warmup_type: ``"log"`` or ``"linear"``.
    """
    if iteration < 0:
        return 0.0
    if iteration >= ramp_steps:
        return 1.0
    if warmup_type == "log":
        return math.log(iteration + 1) / math.log(ramp_steps)
    return iteration / ramp_steps


def _check_warmup_type(value: object) -> str:
    if value not in _WARMUP_TYPES:
        refuse("warmup_type", f"must be one of {list(_WARMUP_TYPES)}, got {value!r}")
    assert isinstance(value, str)
    return value


def _check_total_steps(total_num_steps: object, warmup_num_steps: object) -> int:
    """`total_num_steps` checked against the (already checked) warm-up length."""
    warmup = check_int("warmup_num_steps", warmup_num_steps, minimum=1)
    total = check_int("total_num_steps", total_num_steps, minimum=1)
    if total < warmup:
        refuse(
            "total_num_steps",
            f"must be at least warmup_num_steps ({warmup}), got {total}; raise total_num_steps "
            "to the length of training or lower warmup_num_steps",
        )
    return total


class WarmupLR(BatchSchedule):
    """Ramps each group's lr from ``warmup_min_lr`` to ``warmup_max_lr``, then holds it.

    Args:
        optimizer: The optimizer (or anything with ``param_groups``) whose lr is set.
        warmup_min_lr: Start lr, a number or one per param group. Default 0.
        warmup_max_lr: Final lr, a number or one per param group. Default: each group's lr in
            the optimizer when the schedule is built.
        warmup_num_steps: Positions the ramp takes (1 behaves as 2, as in DeepSpeed).
        warmup_type: ``"log"`` (default) or ``"linear"`` ramp.
        last_batch_iteration: Position to start at; -1 starts from the beginning.

    Raises:
        ConfigError: On a bad value, naming the parameter.
    """

    def __init__(
        self,
        optimizer: ParamGroupOwner,
        warmup_min_lr: float | Sequence[float] = 0.0,
        warmup_max_lr: float | Sequence[float] | None = None,
        warmup_num_steps: int = 1000,
        warmup_type: WarmupType = "log",
        last_batch_iteration: int = -1,
    ) -> None:
        super().__init__(optimizer, last_batch_iteration)
        self.warmup_num_steps = check_int("warmup_num_steps", warmup_num_steps, minimum=1)
        self.warmup_type = _check_warmup_type(warmup_type)
        self.min_lrs = check_per_group("warmup_min_lr", warmup_min_lr, self.group_count, minimum=0)
        self._max_from_optimizer = warmup_max_lr is None
        if warmup_max_lr is None:
            self.max_lrs = group_lrs(optimizer)
        else:
            self.max_lrs = check_per_group(
                "warmup_max_lr", warmup_max_lr, self.group_count, minimum=0
            )
        self._apply()

    @property
    def ramp_steps(self) -> int:
        """Positions the ramp takes: ``max(2, warmup_num_steps)``."""
        return max(2, self.warmup_num_steps)

    def _gamma(self, iteration: int) -> float:
        return warmup_fraction(iteration, self.ramp_steps, self.warmup_type)

    def _lrs_at(self, iteration: int) -> list[float]:
        gamma = self._gamma(iteration)
        return [
            low + (high - low) * gamma for low, high in zip(self.min_lrs, self.max_lrs, strict=True)
        ]

    def _extra_state(self) -> dict[str, Any]:
        # A max lr read from the optimizer cannot be read again once the schedule has written
        # the optimizer's lr, so it travels with the position.
        return {"base_lrs": list(self.max_lrs)} if self._max_from_optimizer else {}

    def _load_extra_state(self, state: dict[str, Any]) -> None:
        base_lrs = restore_base_lrs(state, self.group_count)
        if base_lrs is not None:
            self.max_lrs = base_lrs


class WarmupDecayLR(WarmupLR):
    """`WarmupLR`'s ramp, then a linear fall to 0 at ``total_num_steps``.

    Args:
        optimizer: The optimizer (or anything with ``param_groups``) whose lr is set.
        total_num_steps: Position at which the lr reaches 0; at least ``warmup_num_steps``.
        warmup_min_lr: Start lr, a number or one per param group. Default 0.
        warmup_max_lr: Peak lr, a number or one per param group. Default 0.001 (DeepSpeed's
            default for this schedule); ``None`` takes each group's lr from the optimizer.
        warmup_num_steps: Positions the ramp takes (1 behaves as 2, as in DeepSpeed).
        warmup_type: ``"log"`` (default) or ``"linear"`` ramp.
        last_batch_iteration: Position to start at; -1 starts from the beginning.

    Raises:
        ConfigError: On a bad value, naming the parameter (``total_num_steps`` below
            ``warmup_num_steps`` included).
    """

    def __init__(
        self,
        optimizer: ParamGroupOwner,
        total_num_steps: int,
        warmup_min_lr: float | Sequence[float] = 0.0,
        warmup_max_lr: float | Sequence[float] | None = 0.001,
        warmup_num_steps: int = 1000,
        warmup_type: WarmupType = "log",
        last_batch_iteration: int = -1,
    ) -> None:
        self.total_num_steps = _check_total_steps(total_num_steps, warmup_num_steps)
        super().__init__(
            optimizer,
            warmup_min_lr=warmup_min_lr,
            warmup_max_lr=warmup_max_lr,
            warmup_num_steps=warmup_num_steps,
            warmup_type=warmup_type,
            last_batch_iteration=last_batch_iteration,
        )

    def _gamma(self, iteration: int) -> float:
        ramp = self.ramp_steps
        if iteration < ramp:
            return warmup_fraction(iteration, ramp, self.warmup_type)
        decay_span = max(1, self.total_num_steps - ramp)
        return max(0.0, (self.total_num_steps - iteration) / decay_span)


class WarmupCosineLR(BatchSchedule):
    """Scales each group's optimizer lr: a warm-up ratio ramp, then a half-cosine decay.

    Args:
        optimizer: The optimizer (or anything with ``param_groups``); its lr at construction is
            the base each ratio multiplies.
        total_num_steps: Position at which the ratio reaches ``cos_min_ratio``; at least
            ``warmup_num_steps``.
        warmup_min_ratio: Ratio at the start of the warm-up. Default 0.
        warmup_num_steps: Positions the ramp takes (1 behaves as 2, as in DeepSpeed).
        cos_min_ratio: Ratio at the end of the cosine. Default 0.0001.
        warmup_type: ``"log"`` (default) or ``"linear"`` ramp.
        last_batch_iteration: Position to start at; -1 starts from the beginning.

    Raises:
        ConfigError: On a bad value, naming the parameter.
    """

    def __init__(
        self,
        optimizer: ParamGroupOwner,
        total_num_steps: int,
        warmup_min_ratio: float = 0.0,
        warmup_num_steps: int = 1000,
        cos_min_ratio: float = 0.0001,
        warmup_type: WarmupType = "log",
        last_batch_iteration: int = -1,
    ) -> None:
        super().__init__(optimizer, last_batch_iteration)
        self.total_num_steps = _check_total_steps(total_num_steps, warmup_num_steps)
        self.warmup_num_steps = check_int("warmup_num_steps", warmup_num_steps, minimum=1)
        self.warmup_min_ratio = check_number("warmup_min_ratio", warmup_min_ratio, minimum=0)
        self.cos_min_ratio = check_number("cos_min_ratio", cos_min_ratio, minimum=0)
        self.warmup_type = _check_warmup_type(warmup_type)
        self.base_lrs = group_lrs(optimizer)
        self._apply()

    @property
    def ramp_steps(self) -> int:
        """Positions the ramp takes: ``max(2, warmup_num_steps)``."""
        return max(2, self.warmup_num_steps)

    def lr_ratio(self, iteration: int) -> float:
        """The factor on each group's base lr at `iteration` (0 before the first step)."""
        if iteration < 0:
            return 0.0
        ramp = self.ramp_steps
        if iteration < ramp:
            fraction = warmup_fraction(iteration, ramp, self.warmup_type)
            return self.warmup_min_ratio + fraction * (1.0 - self.warmup_min_ratio)
        decay_span = max(1, self.total_num_steps - ramp)
        progress = min(1.0, (iteration - ramp + 1) / decay_span)
        cosine = (1.0 + math.cos(math.pi * progress)) / 2.0
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * cosine)

    def _lrs_at(self, iteration: int) -> list[float]:
        ratio = self.lr_ratio(iteration)
        return [base * ratio for base in self.base_lrs]

    def _extra_state(self) -> dict[str, Any]:
        return {"base_lrs": list(self.base_lrs)}

    def _load_extra_state(self, state: dict[str, Any]) -> None:
        base_lrs = restore_base_lrs(state, self.group_count)
        if base_lrs is not None:
            self.base_lrs = base_lrs
