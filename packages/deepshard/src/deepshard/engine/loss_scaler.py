"""Loss scaling for float16 training: a static scale, or DeepSpeed's dynamic rules.

float16 cannot hold gradients much below 6e-8, so the loss is multiplied by a *scale* before
backward and the gradients are divided by it before the optimizer step (ZeRO does the division,
fused with clipping). A scale too large makes some gradient overflow to inf/nan: that step is
skipped and the scale reacts. The rules, as DeepSpeed 0.19.7 applies them (``fp16`` section):

* The scale starts at ``2 ** initial_scale_power``. A static ``loss_scale`` (> 0) never changes.
* **Overflow.** With hysteresis left above 1 (and ``hysteresis`` > 1), only the hysteresis
  budget drops by one. Otherwise the scale is halved, but never below ``min_loss_scale``; an
  overflow when the scale already *is* the minimum is an error (the model overflows at every
  scale). Halving does not refill the budget, so once it is spent every overflow halves.
* **Clean step.** With ``consecutive_hysteresis`` the budget is refilled at every clean step.
  Counting update calls from 0, a clean call ``i`` doubles the scale when ``i - j - 1`` is a
  positive multiple of ``loss_scale_window``, ``j`` being the call of the last overflow (-1
  before any). From a fresh start the first doubling is therefore at call ``window`` (the
  ``window + 1``-th clean step), and after an overflow at call ``j`` at call ``j + window + 1``.
  Without ``consecutive_hysteresis`` a doubling also refills the budget.

The scalers are plain Python: no torch, no process group (every rank sees the same global
overflow flag, so every rank's scaler takes the same path).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from deepshard.interface.config import Fp16Config
from deepshard.interface.errors import CheckpointError, ConfigError

__all__ = ["DynamicLossScaler", "LossScaler", "StaticLossScaler", "build_loss_scaler"]

SCALE_FACTOR = 2.0
"""What the dynamic scale is divided by on overflow and multiplied by after a clean window."""


class LossScaler(Protocol):
    """What the engine needs from a loss scaler."""

    @property
    def scale(self) -> float:
        """The factor the next backward pass multiplies the loss by."""
        ...

    @property
    def dynamic(self) -> bool:
        """Whether the scale reacts to overflows."""
        ...

    def update(self, overflow: bool) -> None:
        """Take the outcome of one optimizer step (skipped for overflow or applied)."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """The scaler's position as plain JSON data."""
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a position saved by `state_dict`."""
        ...


@dataclass
class StaticLossScaler:
    """A constant scale: 1.0 for fp32/bf16 training, ``fp16.loss_scale`` when it is set.

    Attributes:
        static_scale: The scale; it never changes.
    """

    static_scale: float = 1.0

    def __post_init__(self) -> None:
        if not self.static_scale > 0:
            raise ConfigError.from_problems(
                [("fp16.loss_scale", f"must be > 0 for a static scale, got {self.static_scale}")]
            )

    @property
    def scale(self) -> float:
        """The constant scale."""
        return self.static_scale

    @property
    def dynamic(self) -> bool:
        """Always false."""
        return False

    def update(self, overflow: bool) -> None:
        """Nothing changes; an overflowing step is still skipped by the optimizer."""

    def state_dict(self) -> dict[str, Any]:
        """``{"scale": ...}``."""
        return {"scale": self.static_scale}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the scale."""
        self.static_scale = float(_field(state, "scale"))


class DynamicLossScaler:
    """DeepSpeed's dynamic loss scale with delayed shift (hysteresis) and a growth window.

    Args:
        initial_scale: The first scale (``2 ** fp16.initial_scale_power``).
        window: ``fp16.loss_scale_window``: clean steps between doublings.
        hysteresis: ``fp16.hysteresis``: overflows absorbed before the scale drops.
        consecutive_hysteresis: ``fp16.consecutive_hysteresis``: refill the budget at every
            clean step.
        min_scale: ``fp16.min_loss_scale``: the scale never drops below this.

    Raises:
        ConfigError: A non-positive scale, window or minimum, or a hysteresis below 1.
    """

    def __init__(
        self,
        *,
        initial_scale: float,
        window: int,
        hysteresis: int,
        consecutive_hysteresis: bool,
        min_scale: float,
    ) -> None:
        problems = [
            (key, f"must be > 0, got {value}")
            for key, value in (
                ("fp16.initial_scale_power", initial_scale),
                ("fp16.loss_scale_window", window),
                ("fp16.min_loss_scale", min_scale),
            )
            if not value > 0
        ]
        if hysteresis < 1:
            problems.append(("fp16.hysteresis", f"must be >= 1, got {hysteresis}"))
        if problems:
            raise ConfigError.from_problems(problems)
        self.window = window
        self.hysteresis = hysteresis
        self.consecutive_hysteresis = consecutive_hysteresis
        self.min_scale = float(min_scale)
        self._scale = float(initial_scale)
        self.iteration = 0
        """Update calls so far."""
        self.last_overflow_iteration = -1
        """The update call of the last overflow; -1 before any."""
        self.hysteresis_left = hysteresis
        """Overflows still absorbed before the next one lowers the scale."""

    @property
    def scale(self) -> float:
        """The current scale."""
        return self._scale

    @property
    def dynamic(self) -> bool:
        """Always true."""
        return True

    def update(self, overflow: bool) -> None:
        """Apply one step's outcome (see the module docstring for the rules).

        Raises:
            ConfigError: An overflow at ``min_loss_scale`` with no hysteresis left.
        """
        if overflow:
            self._on_overflow()
        else:
            self._on_clean_step()
        self.iteration += 1

    def _on_overflow(self) -> None:
        if self.hysteresis > 1 and self.hysteresis_left > 1:
            self.hysteresis_left -= 1
        elif self._scale == self.min_scale:
            raise ConfigError.from_problems(
                [
                    (
                        "fp16.min_loss_scale",
                        f"gradients overflow although the loss scale is already the minimum "
                        f"{self.min_scale:g}: the model produces inf/nan gradients at "
                        "every scale; lower fp16.min_loss_scale, lower the learning rate, or "
                        "train in bf16",
                    )
                ]
            )
        else:
            self._scale = max(self._scale / SCALE_FACTOR, self.min_scale)
        self.last_overflow_iteration = self.iteration

    def _on_clean_step(self) -> None:
        if self.consecutive_hysteresis:
            self.hysteresis_left = self.hysteresis
        stable = self.iteration - self.last_overflow_iteration - 1
        if stable > 0 and stable % self.window == 0:
            if not self.consecutive_hysteresis:
                self.hysteresis_left = self.hysteresis
            self._scale *= SCALE_FACTOR

    def state_dict(self) -> dict[str, Any]:
        """The position: scale, update count, last overflow and hysteresis left."""
        return {
            "scale": self._scale,
            "iteration": self.iteration,
            "last_overflow_iteration": self.last_overflow_iteration,
            "hysteresis_left": self.hysteresis_left,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a position saved by `state_dict` (the settings stay the config's).

        Raises:
            CheckpointError: A field is missing.
        """
        self._scale = float(_field(state, "scale"))
        self.iteration = int(_field(state, "iteration"))
        self.last_overflow_iteration = int(_field(state, "last_overflow_iteration"))
        self.hysteresis_left = int(_field(state, "hysteresis_left"))


def _field(state: dict[str, Any], key: str) -> Any:
    if key not in state:
        raise CheckpointError(
            f"loss scaler state has no {key!r} (keys: {sorted(state)}); it was not saved by "
            "this scaler's state_dict()"
        )
    return state[key]


def build_loss_scaler(fp16: Fp16Config, *, scaled: bool) -> LossScaler:
    """The scaler for a run.

    Args:
        fp16: The ``fp16`` section, whose scaling settings apply.
        scaled: Whether the run computes in float16 (``fp16.enabled``, or ``torch_autocast``
            in float16); otherwise the scale is a constant 1.

    Returns:
        A `StaticLossScaler` or a `DynamicLossScaler`.
    """
    if not scaled:
        return StaticLossScaler(1.0)
    if not fp16.dynamic_loss_scale:
        return StaticLossScaler(fp16.loss_scale)
    return DynamicLossScaler(
        initial_scale=2.0**fp16.initial_scale_power,
        window=fp16.loss_scale_window,
        hysteresis=fp16.hysteresis,
        consecutive_hysteresis=fp16.consecutive_hysteresis,
        min_scale=fp16.min_loss_scale,
    )
