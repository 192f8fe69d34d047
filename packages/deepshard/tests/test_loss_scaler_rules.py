"""The loss scalers alone, against sequences worked out by hand from DeepSpeed's rules.

The rules (module docstring of ``deepshard.engine.loss_scaler``): an overflow spends one unit of
hysteresis while more than one is left, otherwise halves the scale (not below the minimum, and
an error at the minimum); a clean update call ``i`` doubles the scale when ``i - j - 1`` is a
positive multiple of the window (``j``: the call of the last overflow, -1 before any); the
hysteresis budget is refilled at every clean call with ``consecutive_hysteresis``, otherwise
only when the scale doubles. ``O`` below is an overflowing step, ``C`` a clean one.
"""

from __future__ import annotations

import pytest

from deepshard.engine.loss_scaler import (
    DynamicLossScaler,
    StaticLossScaler,
    build_loss_scaler,
)
from deepshard.interface.config import Fp16Config
from deepshard.interface.errors import CheckpointError, ConfigError


def _scaler(**overrides: object) -> DynamicLossScaler:
    settings: dict[str, object] = {
        "initial_scale": 16.0,
        "window": 1000,
        "hysteresis": 2,
        "consecutive_hysteresis": False,
        "min_scale": 1.0,
    }
    settings.update(overrides)
    return DynamicLossScaler(**settings)  # type: ignore[arg-type]


def _run(scaler: DynamicLossScaler, steps: str) -> tuple[list[float], list[int]]:
    """Feed ``steps`` ("O"/"C") and record the scale and hysteresis left after each."""
    scales, left = [], []
    for step in steps:
        scaler.update(step == "O")
        scales.append(scaler.scale)
        left.append(scaler.hysteresis_left)
    return scales, left


def test_clean_steps_double_the_scale_every_window_counted_from_call_zero() -> None:
    # Calls 0..6 clean, window 3: i - (-1) - 1 = i is a positive multiple of 3 at calls 3 and 6.
    scales, _ = _run(_scaler(window=3), "CCCCCCC")
    assert scales == [16, 16, 16, 32, 32, 32, 64]


def test_after_an_overflow_the_next_doubling_is_window_plus_one_calls_later() -> None:
    # Hysteresis 1: the overflow at call 0 halves 16 -> 8; i - 0 - 1 = 2 first at call 3.
    scales, _ = _run(_scaler(window=2, hysteresis=1), "OCCCCC")
    assert scales == [8, 8, 8, 16, 16, 32]


def test_hysteresis_absorbs_overflows_then_every_overflow_halves() -> None:
    # Hysteresis 2: the first overflow only spends the budget (2 -> 1); from then on, with no
    # window reached, the budget stays at 1 and every overflow halves the scale.
    scales, left = _run(_scaler(), "OOOC")
    assert scales == [16, 8, 4, 4]
    assert left == [1, 1, 1, 1]


def test_without_consecutive_hysteresis_only_a_doubling_refills_the_budget() -> None:
    # Window 2: overflow at call 0 (budget 2 -> 1); call 3 has 3 - 0 - 1 = 2 and doubles,
    # refilling the budget to 2; the overflow at call 4 spends it again without halving.
    scales, left = _run(_scaler(window=2), "OCCCO")
    assert scales == [16, 16, 16, 32, 32]
    assert left == [1, 1, 1, 2, 1]


def test_consecutive_hysteresis_refills_the_budget_at_every_clean_step() -> None:
    scales, left = _run(_scaler(consecutive_hysteresis=True), "OCOOC")
    assert scales == [16, 16, 16, 8, 8]
    assert left == [1, 2, 1, 1, 2]


def test_the_scale_stops_at_the_minimum_and_an_overflow_there_is_an_error() -> None:
    scaler = _scaler(initial_scale=8.0, hysteresis=1, min_scale=5.0)
    scaler.update(True)
    assert scaler.scale == 5.0  # max(8 / 2, 5)
    with pytest.raises(ConfigError) as caught:
        scaler.update(True)
    assert caught.value.problems[0][0] == "fp16.min_loss_scale"


def test_a_static_scale_never_changes() -> None:
    scaler = StaticLossScaler(128.0)
    for overflow in (True, False, True):
        scaler.update(overflow)
    assert scaler.scale == 128.0
    assert not scaler.dynamic


def test_build_follows_the_fp16_section() -> None:
    dynamic = build_loss_scaler(Fp16Config(enabled=True), scaled=True)
    assert isinstance(dynamic, DynamicLossScaler)
    assert dynamic.scale == 2.0**16  # initial_scale_power 16
    assert (dynamic.window, dynamic.hysteresis, dynamic.min_scale) == (1000, 2, 1.0)
    static = build_loss_scaler(Fp16Config(enabled=True, loss_scale=128), scaled=True)
    assert isinstance(static, StaticLossScaler) and static.scale == 128.0
    unscaled = build_loss_scaler(Fp16Config(enabled=True, loss_scale=128), scaled=False)
    assert unscaled.scale == 1.0


def test_state_round_trip_resumes_the_same_sequence() -> None:
    first = _scaler(window=2)
    _run(first, "OCC")
    resumed = _scaler(window=2)
    resumed.load_state_dict(first.state_dict())
    assert _run(resumed, "CCOO") == _run(first, "CCOO")
    with pytest.raises(CheckpointError, match="hysteresis_left"):
        resumed.load_state_dict({"scale": 1.0, "iteration": 0, "last_overflow_iteration": -1})


def test_bad_settings_name_their_keys() -> None:
    with pytest.raises(ConfigError) as caught:
        _scaler(hysteresis=0, window=0)
    keys = {key for key, _ in caught.value.problems}
    assert keys == {"fp16.hysteresis", "fp16.loss_scale_window"}
