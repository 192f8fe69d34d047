"""WarmupLR, WarmupDecayLR and WarmupCosineLR produce DeepSpeed's closed-form sequences.

Each expected value is computed here from the formula written in the test; position -1 is the
value written at construction, position k the value after k + 1 calls of ``step()``.
"""

from __future__ import annotations

import math
from typing import Literal

import pytest
import torch

from deepshard.interface.errors import ConfigError
from deepshard.optimizers.schedules import WarmupCosineLR, WarmupDecayLR, WarmupLR

POSITIONS = range(-1, 30)


def _optimizer(*lrs: float) -> torch.optim.Optimizer:
    groups = [{"params": [torch.nn.Parameter(torch.zeros(1))], "lr": lr} for lr in lrs]
    return torch.optim.SGD(groups, lr=lrs[0])


def _trace(schedule: object, optimizer: torch.optim.Optimizer) -> list[list[float]]:
    """The lr of each group at construction and after each of 30 steps."""
    seen = [[float(g["lr"]) for g in optimizer.param_groups]]
    for _ in range(len(POSITIONS) - 1):
        schedule.step()  # type: ignore[attr-defined]
        seen.append([float(g["lr"]) for g in optimizer.param_groups])
    return seen


def _flat(rows: list[list[float]]) -> list[float]:
    return [value for row in rows for value in row]


def _log_ramp(i: int, n: int) -> float:
    return 0.0 if i < 0 else (math.log(i + 1) / math.log(n) if i < n else 1.0)


def _linear_ramp(i: int, n: int) -> float:
    return 0.0 if i < 0 else (i / n if i < n else 1.0)


def test_warmup_lr_log_ramp_then_hold() -> None:
    low, high, n = 0.001, 0.01, 10
    optimizer = _optimizer(0.5)
    schedule = WarmupLR(optimizer, warmup_min_lr=low, warmup_max_lr=high, warmup_num_steps=n)
    expected = [[low + (high - low) * _log_ramp(i, n)] for i in POSITIONS]
    assert expected[0] == [low] and expected[1] == [low]  # positions -1 and 0 both start low
    assert _flat(_trace(schedule, optimizer)) == pytest.approx(_flat(expected), rel=1e-12)
    assert schedule.get_last_lr() == pytest.approx([high])


def test_warmup_lr_linear_with_one_step_ramps_over_two() -> None:
    # DeepSpeed lifts warmup_num_steps=1 to 2 (a log ramp over 1 step would divide by log 1).
    optimizer = _optimizer(0.5)
    schedule = WarmupLR(
        optimizer, warmup_min_lr=0.0, warmup_max_lr=0.2, warmup_num_steps=1, warmup_type="linear"
    )
    expected = [[0.2 * _linear_ramp(i, 2)] for i in POSITIONS]
    assert expected[2] == [0.1]
    assert _flat(_trace(schedule, optimizer)) == pytest.approx(_flat(expected), rel=1e-12)


def test_warmup_lr_max_defaults_to_optimizer_lr_per_group() -> None:
    optimizer = _optimizer(0.02, 0.04)
    schedule = WarmupLR(optimizer, warmup_min_lr=[0.0, 0.001], warmup_num_steps=6)
    assert schedule.get_last_lr() == [0.0, 0.001]
    expected = [
        [0.02 * _log_ramp(i, 6), 0.001 + (0.04 - 0.001) * _log_ramp(i, 6)] for i in POSITIONS
    ]
    assert _flat(_trace(schedule, optimizer)) == pytest.approx(_flat(expected), rel=1e-12)


def test_warmup_decay_lr_linear_ramp_then_linear_fall_to_zero() -> None:
    low, high, n, total = 0.0005, 0.02, 8, 20
    optimizer = _optimizer(0.5, 0.5)
    schedule = WarmupDecayLR(
        optimizer,
        total_num_steps=total,
        warmup_min_lr=low,
        warmup_max_lr=[high, 2 * high],
        warmup_num_steps=n,
        warmup_type="linear",
    )

    def gamma(i: int) -> float:
        if i < n:
            return _linear_ramp(i, n)
        return max(0.0, (total - i) / (total - n))

    expected = [[low + (peak - low) * gamma(i) for peak in (high, 2 * high)] for i in POSITIONS]
    assert expected[POSITIONS.index(20)] == [low, low] and expected[-1] == [low, low]
    assert _flat(_trace(schedule, optimizer)) == pytest.approx(
        _flat(expected), rel=1e-12, abs=1e-18
    )


def test_warmup_decay_lr_log_ramp_and_default_peak() -> None:
    n, total = 5, 12
    optimizer = _optimizer(0.5)
    schedule = WarmupDecayLR(optimizer, total_num_steps=total, warmup_num_steps=n)

    def lr(i: int) -> float:  # DeepSpeed's WarmupDecayLR peak defaults to 0.001
        gamma = _log_ramp(i, n) if i < n else max(0.0, (total - i) / (total - n))
        return 0.001 * gamma

    expected = [[lr(i)] for i in POSITIONS]
    assert _flat(_trace(schedule, optimizer)) == pytest.approx(_flat(expected), abs=1e-18)


@pytest.mark.parametrize("warmup_type", ["log", "linear"])
def test_warmup_cosine_lr_scales_optimizer_lr(warmup_type: Literal["log", "linear"]) -> None:
    base, n, total, w_min, c_min = 0.1, 5, 25, 0.2, 0.1
    optimizer = _optimizer(base, 3 * base)
    schedule = WarmupCosineLR(
        optimizer,
        total_num_steps=total,
        warmup_min_ratio=w_min,
        warmup_num_steps=n,
        cos_min_ratio=c_min,
        warmup_type=warmup_type,
    )
    ramp = _log_ramp if warmup_type == "log" else _linear_ramp

    def ratio(i: int) -> float:
        if i < 0:
            return 0.0  # DeepSpeed's first optimizer step runs with lr 0
        if i < n:
            return w_min + (1 - w_min) * ramp(i, n)
        progress = min(1.0, (i - n + 1) / (total - n))
        return c_min + (1 - c_min) * 0.5 * (1 + math.cos(math.pi * progress))

    expected = [[base * ratio(i), 3 * base * ratio(i)] for i in POSITIONS]
    assert expected[-1] == pytest.approx([base * c_min, 3 * base * c_min])
    assert _flat(_trace(schedule, optimizer)) == pytest.approx(
        _flat(expected), rel=1e-12, abs=1e-18
    )


def test_explicit_position_jumps_and_resume_position_is_written() -> None:
    optimizer = _optimizer(0.5)
    schedule = WarmupLR(optimizer, warmup_max_lr=0.01, warmup_num_steps=10, warmup_type="linear")
    schedule.step(7)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.01 * 7 / 10)
    resumed = WarmupLR(
        _optimizer(0.5),
        warmup_max_lr=0.01,
        warmup_num_steps=10,
        warmup_type="linear",
        last_batch_iteration=4,
    )
    assert resumed.get_last_lr() == pytest.approx([0.01 * 4 / 10])


def test_tensor_lr_is_filled_in_place() -> None:
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.Adam([param], lr=torch.tensor(0.01))
    lr_tensor = optimizer.param_groups[0]["lr"]
    schedule = WarmupLR(optimizer, warmup_num_steps=4, warmup_type="linear")
    schedule.step()
    schedule.step()
    assert optimizer.param_groups[0]["lr"] is lr_tensor
    assert float(lr_tensor) == pytest.approx(0.01 * 1 / 4)
    assert schedule.get_last_lr() == pytest.approx([0.0025])


@pytest.mark.parametrize(
    ("kwargs", "key"),
    [
        ({"warmup_max_lr": [0.1, 0.2, 0.3]}, "warmup_max_lr"),
        ({"warmup_min_lr": [0.0]}, "warmup_min_lr"),
        ({"warmup_min_lr": [0.0, -1.0]}, "warmup_min_lr[1]"),
        ({"warmup_num_steps": 0}, "warmup_num_steps"),
        ({"warmup_num_steps": 10.0}, "warmup_num_steps"),
        ({"warmup_type": "cosine"}, "warmup_type"),
        ({"last_batch_iteration": -2}, "last_batch_iteration"),
    ],
)
def test_warmup_lr_bad_values_name_the_parameter(kwargs: dict[str, object], key: str) -> None:
    optimizer = _optimizer(0.1, 0.1)
    with pytest.raises(ConfigError) as info:
        WarmupLR(optimizer, **kwargs)  # type: ignore[arg-type]
    assert [path for path, _ in info.value.problems] == [key]
    assert optimizer.param_groups[0]["lr"] == 0.1  # nothing written on failure


def test_total_steps_below_warmup_is_refused_with_the_fix() -> None:
    for cls in (WarmupDecayLR, WarmupCosineLR):
        with pytest.raises(ConfigError, match="warmup_num_steps") as info:
            cls(_optimizer(0.1), total_num_steps=5, warmup_num_steps=10)
        assert info.value.problems[0][0] == "total_num_steps"
