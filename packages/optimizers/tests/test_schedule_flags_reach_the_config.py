"""DeepSpeed's schedule flags, parsed by `add_schedule_arguments`, reach the config and the
schedule `build_scheduler` builds from it (the WarmupCosineLR ratios included)."""

from __future__ import annotations

import argparse
import copy
import math

import pytest
import torch

from deepshard.interface.config import DeepShardConfig
from deepshard.interface.errors import ConfigError
from deepshard.optimizers import (
    LRRangeTest,
    OneCycle,
    WarmupCosineLR,
    add_schedule_arguments,
    build_scheduler,
    schedule_config_from_args,
)


def _args(*argv: str) -> argparse.Namespace:
    parser = add_schedule_arguments(argparse.ArgumentParser())
    parser.add_argument("--local_rank", type=int, default=0)  # a script's own flag beside them
    return parser.parse_args(list(argv))


def _schedule(config: DeepShardConfig, lr: float = 0.5) -> object:
    assert config.scheduler is not None
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr, momentum=0.9)
    return build_scheduler(config.scheduler, optimizer)


def test_cosine_ratios_reach_the_schedule() -> None:
    args = _args(
        "--lr_schedule",
        "WarmupCosineLR",
        "--warmup_min_ratio",
        "0.2",
        "--cos_min_ratio",
        "0.05",
        "--warmup_num_steps",
        "4",
        "--total_num_steps",
        "20",
        "--warmup_type",
        "linear",
    )
    config = schedule_config_from_args(args, DeepShardConfig.from_dict({}))
    assert config.scheduler is not None
    assert config.scheduler.params == {
        "warmup_min_ratio": 0.2,
        "cos_min_ratio": 0.05,
        "warmup_num_steps": 4,
        "total_num_steps": 20,
        "warmup_type": "linear",
    }
    schedule = _schedule(config)
    assert isinstance(schedule, WarmupCosineLR)
    for _ in range(20):
        schedule.step()
    # the cosine ends at cos_min_ratio × the optimizer's lr (0.5)
    assert math.isclose(schedule.get_lr()[0], 0.05 * 0.5, rel_tol=1e-9)


def test_staircase_is_off_unless_asked() -> None:
    plain = schedule_config_from_args(_args("--lr_schedule", "LRRangeTest"))
    assert plain["scheduler"] == {"type": "LRRangeTest", "params": {}}
    on = _args("--lr_schedule", "LRRangeTest", "--lr_range_test_staircase")
    config = DeepShardConfig.from_dict(schedule_config_from_args(on))
    schedule = _schedule(config)
    assert isinstance(schedule, LRRangeTest) and schedule.staircase
    off = schedule_config_from_args(_args("--no-lr_range_test_staircase"), config)
    assert off.scheduler is not None and off.scheduler.params["lr_range_test_staircase"] is False


def test_flags_override_the_configs_params_without_changing_the_dict() -> None:
    raw = {
        "scheduler": {
            "type": "OneCycle",
            "params": {"cycle_min_lr": 0.001, "cycle_max_lr": 0.01, "cycle_first_step_size": 7},
        }
    }
    before = copy.deepcopy(raw)
    out = schedule_config_from_args(_args("--cycle_max_lr", "0.3", "--decay_lr_rate", "0.1"), raw)
    assert raw == before
    assert out["scheduler"]["params"] == {
        "cycle_min_lr": 0.001,
        "cycle_max_lr": 0.3,
        "cycle_first_step_size": 7,
        "decay_lr_rate": 0.1,
    }
    schedule = _schedule(DeepShardConfig.from_dict(out))
    assert isinstance(schedule, OneCycle)
    # a new type starts from the flags alone, with OneCycle's bounds from DeepSpeed's defaults
    fresh = schedule_config_from_args(
        _args("--lr_schedule", "OneCycle"),
        {"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 3}}},
    )
    assert fresh["scheduler"]["params"] == {"cycle_min_lr": 0.01, "cycle_max_lr": 0.1}


def test_nothing_given_changes_nothing() -> None:
    config = DeepShardConfig.from_dict({})
    assert schedule_config_from_args(_args(), config) is config
    assert schedule_config_from_args(_args(), {"train_batch_size": 2}) == {"train_batch_size": 2}


def test_wrong_flags_are_named() -> None:
    with pytest.raises(ConfigError, match="--cycle_min_lr: not a parameter of the WarmupLR"):
        schedule_config_from_args(_args("--lr_schedule", "WarmupLR", "--cycle_min_lr", "0.1"))
    with pytest.raises(ConfigError, match="--warmup_num_steps was given but the config has no"):
        schedule_config_from_args(_args("--warmup_num_steps", "5"))
    with pytest.raises(SystemExit):  # argparse lists the schedule types
        _args("--lr_schedule", "Cosine")
