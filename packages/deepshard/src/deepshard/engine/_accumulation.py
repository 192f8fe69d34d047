"""Gradient accumulation: which micro-step ends an accumulation cycle, and the step counters.

The caller calls ``engine.step()`` after every micro-batch. Counting those calls from 0
(``micro_steps``), micro-step ``k`` is a *boundary* when ``(k + 1)`` is a multiple of
``gradient_accumulation_steps``: its backward pass reduces the accumulated gradients and its
``step()`` applies them. So with 4 accumulation steps the updates come at the 4th, 8th, 12th...
call. Every boundary counts as a global step and adds ``train_batch_size`` samples, whether the
update was applied or skipped for overflow (as DeepSpeed counts); skipped ones are also counted
in ``skipped_steps``.

A script may instead declare the boundary itself (DeepSpeed's
``set_gradient_accumulation_boundary``): ``override`` then replaces the counter's answer until it
is set back to None, so ``step()`` applies an update exactly when the script said so.

With ``managed_gradient_accumulation: false`` the caller owns the cycle: every ``step()`` is a
boundary and no backward pass is (``is_boundary`` is true only while ``step()`` runs), so the
number of micro-batches may change from step to step. Each step counts the samples of the
backward passes it ended (``backwards`` x ``train_batch_size / gradient_accumulation_steps``),
as DeepSpeed does.
"""

from __future__ import annotations

from typing import Any

from deepshard.interface.errors import CheckpointError

__all__ = ["GradientAccumulation"]

_FIELDS = ("micro_steps", "global_steps", "global_samples", "skipped_steps")


class GradientAccumulation:
    """The accumulation counter and the step counters.

    Args:
        steps: ``gradient_accumulation_steps``.
        train_batch_size: Samples per optimizer step over all data-parallel ranks.
        managed: ``managed_gradient_accumulation``.
    """

    def __init__(self, steps: int, train_batch_size: int, *, managed: bool = True) -> None:
        self.steps = steps
        self.train_batch_size = train_batch_size
        self.managed = managed
        """False: the caller ends each cycle by calling ``step()``."""
        self.stepping = False
        """Unmanaged: ``step()`` is running (the boundary)."""
        self.backwards = 0
        """Backward passes since the last ``step()``."""
        self.micro_steps = 0
        """``step()`` calls so far."""
        self.global_steps = 0
        """Accumulation boundaries so far (applied or skipped updates)."""
        self.global_samples = 0
        """Samples consumed by the boundaries so far."""
        self.skipped_steps = 0
        """Boundaries whose update was skipped for overflow."""
        self.override: bool | None = None
        """The boundary the script declared; None follows the counter."""

    def is_boundary(self) -> bool:
        """Whether the current micro-step (the next ``step()`` call) ends a cycle."""
        if not self.managed:
            return self.stepping
        if self.override is not None:
            return self.override
        return (self.micro_steps + 1) % self.steps == 0

    def advance(self, *, applied: bool) -> None:
        """Count one ``step()`` call; at a boundary, count the optimizer step too.

        Args:
            applied: At a boundary, whether the update was applied (False: skipped for
                overflow). Ignored elsewhere.
        """
        if self.is_boundary():
            self.global_steps += 1
            if self.managed:
                self.global_samples += self.train_batch_size
            else:
                self.global_samples += self.train_batch_size // self.steps * self.backwards
            if not applied:
                self.skipped_steps += 1
        self.micro_steps += 1
        self.backwards = 0

    def state_dict(self) -> dict[str, Any]:
        """The counters as plain JSON data."""
        return {name: getattr(self, name) for name in _FIELDS}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore counters saved by `state_dict`.

        Raises:
            CheckpointError: A counter is missing.
        """
        missing = [name for name in _FIELDS if name not in state]
        if missing:
            raise CheckpointError(f"accumulation state lacks {missing}; keys: {sorted(state)}")
        for name in _FIELDS:
            setattr(self, name, int(state[name]))
