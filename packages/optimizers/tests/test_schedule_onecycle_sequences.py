"""OneCycle: lr and momentum through the cycle, its stairs and the decay phase (DeepSpeed's).

Expected values come from the formulas written here: Smith's triangular formula for the
smooth symmetric cycle, stair lengths for the staircase, and the decay factors
``1 / (1 + rate * d / size)`` (lr) and ``1 + rate * d / size`` (momentum).
"""

from __future__ import annotations

import math
from typing import cast

import pytest
import torch

from deepshard.interface.errors import ConfigError
from deepshard.optimizers.schedules import OneCycle

POSITIONS = range(-1, 30)


def _params() -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(torch.zeros(1))]


def _trace(schedule: OneCycle, optimizer: torch.optim.Optimizer, key: str) -> list[float]:
    """(lr, momentum) of group 0 at construction and after each of 30 steps, flattened."""

    def read() -> list[float]:
        group = optimizer.param_groups[0]
        momentum = group["betas"][0] if key == "betas" else group[key]
        return [float(group["lr"]), float(momentum)]

    seen = read()
    for _ in range(len(POSITIONS) - 1):
        schedule.step()
        seen += read()
    return seen


def test_smooth_symmetric_cycle_follows_smiths_triangle_then_holds() -> None:
    low, high, m_low, m_high, half = 0.001, 0.01, 0.85, 0.95, 5
    optimizer = torch.optim.Adam(_params(), lr=0.5, betas=(0.9, 0.999))
    schedule = OneCycle(
        optimizer,
        cycle_min_lr=low,
        cycle_max_lr=high,
        cycle_first_step_size=half,
        cycle_min_mom=m_low,
        cycle_max_mom=m_high,
    )

    def triangle(i: int) -> float:  # Smith (2017), iteration = batches done = i + 1
        iteration = i + 1
        cycle = math.floor(1 + iteration / (2 * half))
        return max(0.0, 1 - abs(iteration / half - 2 * cycle + 1))

    expected: list[float] = []
    for i in POSITIONS:
        scale = triangle(i) if i < 2 * half else 0.0  # no decay configured: hold the low end
        momentum = m_low if i < 0 else (m_high - (m_high - m_low) * scale)
        expected += [low + (high - low) * scale, momentum]
    assert expected[:2] == [low, m_low]  # DeepSpeed's construction values
    assert _trace(schedule, optimizer, "betas") == pytest.approx(expected, rel=1e-12)
    assert optimizer.param_groups[0]["betas"][1] == 0.999  # beta2 is the user's, untouched


def test_staircase_cycle_and_decay_phase() -> None:
    low, high, m_low, m_high = 0.001, 0.01, 0.85, 0.95
    up, down, up_stairs, down_stairs, decay_size, lr_rate, mom_rate = 6, 4, 3, 2, 2, 0.5, 0.01
    optimizer = torch.optim.SGD(_params(), lr=0.5, momentum=0.0)
    schedule = OneCycle(
        optimizer,
        cycle_min_lr=low,
        cycle_max_lr=high,
        decay_lr_rate=lr_rate,
        cycle_first_step_size=up,
        cycle_second_step_size=down,
        cycle_first_stair_count=up_stairs,
        cycle_second_stair_count=down_stairs,
        decay_step_size=decay_size,
        cycle_min_mom=m_low,
        cycle_max_mom=m_high,
        decay_mom_rate=mom_rate,
    )
    up_stair_len, down_stair_len = up // up_stairs, down // down_stairs  # 2 positions each
    expected: list[float] = []
    for i in POSITIONS:
        batches = i + 1
        if batches <= up:
            scale = (batches // up_stair_len) / up_stairs
        elif batches < up + down:
            scale = ((up + down - batches) // down_stair_len) / down_stairs
        else:
            scale = 0.0
        if i < up + down:
            lr = low + (high - low) * scale
            momentum = m_low if i < 0 else m_high - (m_high - m_low) * scale
        else:
            intervals = (i - (up + down) + 1) / decay_size
            lr = low / (1 + lr_rate * intervals)
            momentum = m_high * (1 + mom_rate * intervals)
        expected += [lr, momentum]
    # The peak (batch 6) reaches max lr; the stairs hold values for two positions.
    assert expected[2 * 6] == pytest.approx(high) and expected[2 * 2] == expected[2 * 3]
    assert _trace(schedule, optimizer, "momentum") == pytest.approx(expected, rel=1e-12)


def test_per_group_bounds_cycle_each_group() -> None:
    params = [_params(), _params()]
    optimizer = torch.optim.AdamW([{"params": p} for p in params], lr=0.5, betas=(0.8, 0.95))
    schedule = OneCycle(
        optimizer,
        cycle_min_lr=[0.001, 0.01],
        cycle_max_lr=[0.002, 0.05],
        cycle_first_step_size=4,
        cycle_second_step_size=2,
        cycle_min_mom=[0.7, 0.8],
        cycle_max_mom=[0.9, 0.85],
    )
    for i in range(-1, 12):
        if i >= 0:
            schedule.step()
        batches = i + 1
        scale = batches / 4 if batches <= 4 else max(0.0, (6 - batches) / 2)
        lrs = [lo + (hi - lo) * scale for lo, hi in ((0.001, 0.002), (0.01, 0.05))]
        moms = (
            [0.7, 0.8]
            if i < 0
            else [hi - (hi - lo) * scale for lo, hi in ((0.7, 0.9), (0.8, 0.85))]
        )
        assert schedule.get_last_lr() == pytest.approx(lrs, rel=1e-12)
        assert [g["betas"][0] for g in optimizer.param_groups] == pytest.approx(moms, rel=1e-12)
        assert [g["betas"][1] for g in optimizer.param_groups] == [0.95, 0.95]
        pairs = cast(list[tuple[float, float]], schedule.get_mom())
        assert [beta2 for _, beta2 in pairs] == [0.95, 0.95]
        assert [beta1 for beta1, _ in pairs] == pytest.approx(moms, rel=1e-12)


@pytest.mark.parametrize("kind", ["adam", "sgd"])
def test_get_mom_answers_in_the_form_the_groups_keep_momentum(kind: str) -> None:
    """Adam-like groups: ``(beta1, beta2)`` pairs, as DeepSpeed's get_mom returns; SGD: values.

    Expected values: a 4-up, 4-down smooth cycle (scale ``c/4`` up, ``(8-c)/4`` down at batch
    offset ``c``), then the decay factor ``1 + rate * d / size``; beta2 is the user's 0.98.
    """
    m_low, m_high, rate, size = 0.8, 0.9, 0.1, 2
    groups = [{"params": _params()}, {"params": _params()}]
    optimizer: torch.optim.Optimizer = (
        torch.optim.Adam(groups, lr=0.1, betas=(0.5, 0.98))
        if kind == "adam"
        else torch.optim.SGD(groups, lr=0.1, momentum=0.5)
    )
    schedule = OneCycle(optimizer, 0.01, 0.1, cycle_first_step_size=4, decay_step_size=size,
                        cycle_min_mom=m_low, cycle_max_mom=m_high, decay_mom_rate=rate)  # fmt: skip
    for i in range(-1, 14):
        if i >= 0:
            schedule.step()
        batches = i + 1
        if i < 0:
            expected = m_low
        elif i < 8:
            scale = batches / 4 if batches <= 4 else (8 - batches) / 4
            expected = m_high - (m_high - m_low) * scale
        else:
            expected = m_high * (1 + rate * (i - 8 + 1) / size)
        got = schedule.get_mom()
        assert got is not None and len(got) == 2
        if kind == "adam":
            pairs = cast(list[tuple[float, float]], got)
            assert all(isinstance(pair, tuple) and len(pair) == 2 for pair in pairs)
            assert [beta2 for _, beta2 in pairs] == [0.98, 0.98]
            assert [beta1 for beta1, _ in pairs] == pytest.approx([expected] * 2, rel=1e-12)
            assert [tuple(g["betas"]) for g in optimizer.param_groups] == pairs  # as written
        else:
            assert got == pytest.approx([expected] * 2, rel=1e-12)
            assert [g["momentum"] for g in optimizer.param_groups] == got


def test_momentum_off_or_unsupported_leaves_momentum_alone() -> None:
    optimizer = torch.optim.SGD(_params(), lr=0.5, momentum=0.5)
    schedule = OneCycle(optimizer, 0.001, 0.01, cycle_first_step_size=3, cycle_momentum=False)
    schedule.step()
    assert optimizer.param_groups[0]["momentum"] == 0.5 and schedule.get_mom() is None

    adagrad = torch.optim.Adagrad(_params(), lr=0.5)
    with pytest.warns(UserWarning, match="neither 'betas' nor 'momentum'"):
        schedule = OneCycle(adagrad, 0.001, 0.01, cycle_first_step_size=3)
    schedule.step()
    assert "momentum" not in adagrad.param_groups[0] and "betas" not in adagrad.param_groups[0]
    assert schedule.get_last_lr() == pytest.approx([0.001 + 0.009 / 3])


@pytest.mark.parametrize(
    ("kwargs", "key"),
    [
        ({"cycle_max_lr": [0.1, 0.2, 0.3]}, "cycle_max_lr"),
        ({"cycle_min_mom": [0.8]}, "cycle_min_mom"),
        ({"cycle_max_mom": 1.5}, "cycle_max_mom"),
        ({"cycle_first_step_size": 0}, "cycle_first_step_size"),
        ({"cycle_second_step_size": -1}, "cycle_second_step_size"),
        ({"cycle_first_stair_count": 1.5}, "cycle_first_stair_count"),
        ({"decay_step_size": -2}, "decay_step_size"),
        ({"cycle_momentum": "yes"}, "cycle_momentum"),
    ],
)
def test_bad_values_name_the_parameter(kwargs: dict[str, object], key: str) -> None:
    optimizer = torch.optim.SGD([{"params": _params()}, {"params": _params()}], lr=0.3)
    arguments: dict[str, object] = {"cycle_min_lr": 0.001, "cycle_max_lr": 0.01, **kwargs}
    with pytest.raises(ConfigError) as info:
        OneCycle(optimizer, **arguments)  # type: ignore[arg-type]
    assert [path for path, _ in info.value.problems] == [key]
    assert optimizer.param_groups[0]["lr"] == 0.3
