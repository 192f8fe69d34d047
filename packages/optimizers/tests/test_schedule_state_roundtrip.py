"""A schedule saved mid-way, through JSON, continues in a fresh schedule with identical values."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

from deepshard.interface.config import SchedulerConfig
from deepshard.interface.errors import CheckpointError
from deepshard.optimizers.schedules import LRSchedule, WarmupCosineLR, WarmupLR, build_scheduler

CASES: list[tuple[str, dict[str, Any]]] = [
    ("WarmupLR", {"warmup_num_steps": 6}),
    ("WarmupLR", {"warmup_min_lr": [0.0, 0.01], "warmup_max_lr": 0.1, "warmup_num_steps": 6}),
    ("WarmupDecayLR", {"total_num_steps": 15, "warmup_num_steps": 5, "warmup_type": "linear"}),
    ("WarmupCosineLR", {"total_num_steps": 15, "warmup_num_steps": 5, "warmup_min_ratio": 0.1}),
    (
        "OneCycle",
        {
            "cycle_min_lr": 0.01,
            "cycle_max_lr": [0.1, 0.2],
            "cycle_first_step_size": 4,
            "cycle_second_step_size": 3,
            "cycle_first_stair_count": 2,
            "decay_step_size": 2,
            "decay_lr_rate": 0.3,
            "decay_mom_rate": 0.01,
        },
    ),
    ("LRRangeTest", {"lr_range_test_step_size": 3, "lr_range_test_staircase": True}),
    ("StepLR", {"step_size": 3, "gamma": 0.5}),
    ("MultiStepLR", {"milestones": [4, 9, 9], "gamma": 0.5}),
    ("CosineAnnealingLR", {"T_max": 10, "eta_min": 0.001}),
    ("OneCycleLR", {"max_lr": 0.3, "total_steps": 40}),
]


def _optimizer() -> torch.optim.Optimizer:
    groups = [{"params": [torch.nn.Parameter(torch.zeros(1))], "lr": lr} for lr in (0.1, 0.2)]
    return torch.optim.Adam(groups, betas=(0.9, 0.999))


def _values(optimizer: torch.optim.Optimizer) -> list[float]:
    return [
        float(g[k] if k == "lr" else g[k][0])
        for g in optimizer.param_groups
        for k in ("lr", "betas")
    ]


def _run(schedule: LRSchedule, optimizer: torch.optim.Optimizer, steps: int) -> list[list[float]]:
    seen = []
    for _ in range(steps):
        optimizer.step()
        schedule.step()
        seen.append([*schedule.get_last_lr(), *_values(optimizer)])
    return seen


@pytest.mark.parametrize(
    ("name", "params"), CASES, ids=[f"{n}-{i}" for i, (n, _) in enumerate(CASES)]
)
def test_fresh_schedule_loaded_mid_way_continues_identically(
    name: str, params: dict[str, Any]
) -> None:
    config = SchedulerConfig(type=name, params=params)
    first_optimizer = _optimizer()
    first = build_scheduler(config, first_optimizer)
    _run(first, first_optimizer, 7)
    saved = json.loads(json.dumps(first.state_dict()))  # must be plain JSON

    # Resume as the engine does: build both, then load the optimizer and the schedule state.
    second_optimizer = _optimizer()
    second = build_scheduler(config, second_optimizer)
    second_optimizer.load_state_dict(first_optimizer.state_dict())
    second.load_state_dict(saved)
    assert second.get_last_lr() == first.get_last_lr()
    assert _values(second_optimizer) == _values(first_optimizer)
    assert _run(second, second_optimizer, 25) == _run(first, first_optimizer, 25)


@pytest.mark.parametrize("cls", [WarmupLR, WarmupCosineLR])
def test_lr_taken_from_optimizer_travels_with_the_state(
    cls: type[WarmupLR] | type[WarmupCosineLR],
) -> None:
    # Rebuilt on an optimizer whose lr the schedule already overwrote (as after loading the
    # optimizer state), the saved base lrs still give the original sequence.
    optimizer = _optimizer()
    kwargs: dict[str, Any] = {"warmup_num_steps": 5}
    if cls is WarmupCosineLR:
        kwargs["total_num_steps"] = 12
    first: WarmupLR | WarmupCosineLR = cls(optimizer, **kwargs)
    for _ in range(3):
        first.step()
    saved = json.loads(json.dumps(first.state_dict()))
    assert saved["base_lrs"] == [0.1, 0.2]
    second = cls(optimizer, **kwargs)
    second.load_state_dict(saved)
    for _ in range(12):
        first.step()
        expected = first.get_last_lr()
        second.step()
        assert second.get_last_lr() == expected


def test_deepspeed_state_loads_and_bad_state_is_refused() -> None:
    schedule = WarmupLR(_optimizer(), warmup_max_lr=0.1, warmup_num_steps=10, warmup_type="linear")
    schedule.load_state_dict({"last_batch_iteration": 4})  # DeepSpeed's own format
    assert schedule.get_last_lr() == pytest.approx([0.04, 0.04])
    # Loading writes the position's values, so the optimizer agrees even without its own state.
    assert [g["lr"] for g in schedule.optimizer.param_groups] == schedule.get_last_lr()
    with pytest.raises(CheckpointError, match="last_batch_iteration"):
        schedule.load_state_dict({"last_batch_iteration": "4"})
    with pytest.raises(CheckpointError, match="unknown keys"):
        schedule.load_state_dict({"last_batch_iteration": 4, "base_lrs": [0.1, 0.1]})
