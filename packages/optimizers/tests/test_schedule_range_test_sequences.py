"""LRRangeTest grows the lr linearly in batches, continuously or (only when asked) in stairs."""

from __future__ import annotations

import pytest
import torch

from deepshard.interface.errors import ConfigError
from deepshard.optimizers.schedules import LRRangeTest


def _optimizer(groups: int = 1) -> torch.optim.Optimizer:
    params = [{"params": [torch.nn.Parameter(torch.zeros(1))]} for _ in range(groups)]
    return torch.optim.SGD(params, lr=0.5)


def _trace(schedule: LRRangeTest, steps: int) -> list[list[float]]:
    seen = [schedule.get_last_lr()]
    for _ in range(steps):
        schedule.step()
        seen.append(schedule.get_last_lr())
    return seen


def test_continuous_growth_is_the_default() -> None:
    low, size, rate = 0.002, 4, 0.5
    schedule = LRRangeTest(
        _optimizer(),
        lr_range_test_min_lr=low,
        lr_range_test_step_size=size,
        lr_range_test_step_rate=rate,
    )
    # Position i (i + 1 batches done): min_lr * (1 + rate * (i + 1) / size).
    expected = [low * (1 + rate * (i + 1) / size) for i in range(-1, 30)]
    assert [row[0] for row in _trace(schedule, 30)] == pytest.approx(expected, rel=1e-12)


def test_staircase_holds_each_interval_and_lists_go_per_group() -> None:
    lows, size, rate = [0.001, 0.004], 3, 2.0
    optimizer = _optimizer(groups=2)
    schedule = LRRangeTest(
        optimizer,
        lr_range_test_min_lr=lows,
        lr_range_test_step_size=size,
        lr_range_test_step_rate=rate,
        lr_range_test_staircase=True,
    )
    seen = _trace(schedule, 30)
    for i, row in zip(range(-1, 30), seen, strict=True):
        whole_intervals = (i + 1) // size
        assert row == pytest.approx([low * (1 + rate * whole_intervals) for low in lows])
    assert seen[0] == seen[1] == seen[2] == lows  # flat for the first interval
    assert [g["lr"] for g in optimizer.param_groups] == seen[-1]


@pytest.mark.parametrize(
    ("kwargs", "key"),
    [
        ({"lr_range_test_min_lr": [0.1, 0.2]}, "lr_range_test_min_lr"),
        ({"lr_range_test_step_size": 0}, "lr_range_test_step_size"),
        ({"lr_range_test_step_rate": -1.0}, "lr_range_test_step_rate"),
        ({"lr_range_test_staircase": 1}, "lr_range_test_staircase"),
    ],
)
def test_bad_values_name_the_parameter(kwargs: dict[str, object], key: str) -> None:
    with pytest.raises(ConfigError) as info:
        LRRangeTest(_optimizer(), **kwargs)  # type: ignore[arg-type]
    assert [path for path, _ in info.value.problems] == [key]
