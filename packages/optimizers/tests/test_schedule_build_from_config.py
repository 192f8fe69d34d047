"""build_scheduler: each DeepSpeed type, torch schedules by name, errors that name the key."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from deepshard.interface.config import SchedulerConfig
from deepshard.interface.errors import ConfigError
from deepshard.optimizers.schedules import (
    LRRangeTest,
    LRSchedule,
    OneCycle,
    TorchSchedule,
    WarmupCosineLR,
    WarmupDecayLR,
    WarmupLR,
    build_scheduler,
)


def _optimizer(lr: float = 0.1) -> torch.optim.Optimizer:
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr, momentum=0.9)


def _build(name: str, params: dict[str, Any], lr: float = 0.1) -> LRSchedule:
    return build_scheduler(SchedulerConfig(type=name, params=params), _optimizer(lr))


def _problem_keys(info: pytest.ExceptionInfo[ConfigError]) -> list[str]:
    return [path for path, _ in info.value.problems]


@pytest.mark.parametrize(
    ("name", "params", "cls", "first_lr"),
    [
        ("WarmupLR", {"warmup_min_lr": 0.01}, WarmupLR, 0.01),
        ("WarmupDecayLR", {"total_num_steps": 50, "warmup_num_steps": 10}, WarmupDecayLR, 0.0),
        ("WarmupCosineLR", {"total_num_steps": 50, "warmup_num_steps": 9}, WarmupCosineLR, 0.0),
        ("OneCycle", {"cycle_min_lr": 0.002, "cycle_max_lr": 0.02}, OneCycle, 0.002),
        ("LRRangeTest", {"lr_range_test_min_lr": 0.003}, LRRangeTest, 0.003),
    ],
)
def test_each_deepspeed_type_builds_and_writes_its_start(
    name: str, params: dict[str, Any], cls: type, first_lr: float
) -> None:
    optimizer = _optimizer()
    schedule = build_scheduler(SchedulerConfig(type=name, params=params), optimizer)
    assert type(schedule) is cls and isinstance(schedule, LRSchedule)
    assert schedule.get_last_lr() == [first_lr] == [optimizer.param_groups[0]["lr"]]


def test_torch_step_lr_by_name_follows_its_closed_form() -> None:
    lr0, step_size, gamma = 0.1, 4, 0.5
    optimizer = _optimizer(lr0)
    config = SchedulerConfig(type="StepLR", params={"step_size": step_size, "gamma": gamma})
    schedule = build_scheduler(config, optimizer)
    assert isinstance(schedule, TorchSchedule) and isinstance(schedule, LRSchedule)
    for epoch in range(30):  # torch counts from 0 at construction
        assert schedule.get_last_lr() == pytest.approx([lr0 * gamma ** (epoch // step_size)])
        optimizer.step()
        schedule.step()


def test_torch_cosine_annealing_by_name_follows_its_closed_form() -> None:
    lr0, t_max, eta_min = 0.1, 12, 0.01
    schedule = _build("CosineAnnealingLR", {"T_max": t_max, "eta_min": eta_min}, lr=lr0)
    assert isinstance(schedule, TorchSchedule)
    optimizer = schedule.scheduler.optimizer
    for epoch in range(t_max + 1):
        cosine = (1 + math.cos(math.pi * epoch / t_max)) / 2
        assert schedule.get_last_lr() == pytest.approx([eta_min + (lr0 - eta_min) * cosine])
        optimizer.step()
        schedule.step()


@pytest.mark.parametrize(
    "name", ["LambdaLR", "MultiplicativeLR", "SequentialLR", "ReduceLROnPlateau"]
)
def test_torch_schedules_json_cannot_express_are_refused(name: str) -> None:
    with pytest.raises(ConfigError, match=name) as info:
        _build(name, {})
    assert _problem_keys(info) == ["scheduler.type"]
    assert "Python" in str(info.value) or "metric" in str(info.value)


def test_unknown_type_lists_the_known_ones() -> None:
    with pytest.raises(ConfigError, match="did you mean 'WarmupLR'") as info:
        _build("WarmUpLR", {})
    assert _problem_keys(info) == ["scheduler.type"]
    for known in ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle", "LRRangeTest"):
        assert known in str(info.value)
    assert "StepLR" in str(info.value)


@pytest.mark.parametrize(
    ("name", "params", "key", "hint"),
    [
        (
            "WarmupLR",
            {"warmup_num_step": 10},
            "scheduler.params.warmup_num_step",
            "warmup_num_steps",
        ),
        ("WarmupDecayLR", {"warmup_num_steps": 10}, "scheduler.params.total_num_steps", "required"),
        (
            "WarmupDecayLR",
            {"total_num_steps": 5, "warmup_num_steps": 10},
            "scheduler.params.total_num_steps",
            "at least warmup_num_steps",
        ),
        ("WarmupLR", {"warmup_type": "exp"}, "scheduler.params.warmup_type", "'linear'"),
        (
            "WarmupLR",
            {"warmup_max_lr": [0.1, 0.2]},
            "scheduler.params.warmup_max_lr",
            "param group",
        ),
        ("OneCycle", {"cycle_min_lr": 0.1}, "scheduler.params.cycle_max_lr", "required"),
        ("LRRangeTest", {"optimizer": "sgd"}, "scheduler.params.optimizer", "remove it"),
        ("StepLR", {"step_sise": 3}, "scheduler.params.step_sise", "step_size"),
        ("StepLR", {}, "scheduler.params.step_size", "required"),
        (
            "CyclicLR",
            {"base_lr": 0.01, "max_lr": 0.1, "scale_fn": "triangular"},
            "scheduler.params.scale_fn",
            "callable",
        ),
        ("CosineAnnealingWarmRestarts", {"T_0": 0}, "scheduler.params", "T_0"),
    ],
)
def test_bad_params_name_their_key(name: str, params: dict[str, Any], key: str, hint: str) -> None:
    with pytest.raises(ConfigError) as info:
        _build(name, params)
    assert key in _problem_keys(info)
    assert hint in str(info.value)


def test_torch_schedule_needs_a_torch_optimizer() -> None:
    class Wrapper:
        def __init__(self) -> None:
            self.param_groups: list[dict[str, Any]] = [{"lr": 0.1}]

    wrapper = Wrapper()
    with pytest.raises(TypeError, match=r"torch\.optim\.Optimizer"):
        build_scheduler(SchedulerConfig(type="StepLR", params={"step_size": 2}), wrapper)
    # DeepSpeed's schedules only need param_groups.
    schedule = build_scheduler(SchedulerConfig(type="LRRangeTest"), wrapper)
    schedule.step()
    assert wrapper.param_groups[0]["lr"] == pytest.approx(1e-3 * (1 + 1 / 2000))
