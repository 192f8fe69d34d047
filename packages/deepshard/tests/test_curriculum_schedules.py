"""Curriculum difficulty sequences, by hand from DeepSpeed's documented formulas and against
DeepSpeed's own ``CurriculumScheduler`` (when the ``bench`` group installed DeepSpeed).

Formulas (DeepSpeed's curriculum tutorial): fixed_linear / fixed_root give
``floor((s / total) ** (1 / degree) * (max - min) + min)`` rounded down to a multiple of
``difficulty_step``, never below ``min_difficulty`` (rounded up to a multiple of the step) nor
above ``max_difficulty``; fixed_discrete gives ``difficulty[i]`` for the first ``s <=
max_step[i]``, then the last one.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from deepshard.engine._checks import check_engine_config
from deepshard.engine.curriculum import (
    CurriculumScheduler,
    scheduled_difficulty,
    truncate_to_seqlen,
)
from deepshard.interface.config import DeepShardConfig, LegacyCurriculumConfig
from deepshard.interface.errors import ConfigError


def _legacy(schedule_type: str, low: int, high: int, **schedule: Any) -> dict[str, Any]:
    return {
        "min_difficulty": low,
        "max_difficulty": high,
        "schedule_type": schedule_type,
        "schedule_config": schedule,
    }


def _updates(raw: dict[str, Any], steps: int, custom: Any = None) -> list[int]:
    scheduler = CurriculumScheduler(
        LegacyCurriculumConfig(enabled=True, curriculum_type="seqlen", **raw)
    )
    scheduler.custom = custom
    return [scheduler.update(step) for step in range(1, steps + 1)]


LINEAR = _legacy("fixed_linear", 8, 64, total_curriculum_step=10, difficulty_step=8)
ROOT = _legacy("fixed_root", 8, 72, total_curriculum_step=16, difficulty_step=8, root_degree=2)
DISCRETE = _legacy("fixed_discrete", 16, 64, difficulty=[16, 32, 64], max_step=[3, 6])


def test_fixed_linear_by_hand() -> None:
    # s/10·56 + 8 floored: 13.6 19.2 24.8 30.4 36 41.6 47.2 52.8 58.4 64, then down to ×8;
    # after 64 (the maximum) the schedule stops moving
    assert _updates(LINEAR, 11) == [8, 16, 24, 24, 32, 40, 40, 48, 56, 64, 64]


def test_fixed_root_by_hand() -> None:
    # sqrt(s/16)·64 + 8: s=1 → 24, s=2 → 30.6 → 24, s=3 → 35.7 → 32, s=4 → 40, s=9 → 56, 16 → 72
    section = LegacyCurriculumConfig(enabled=True, **ROOT)
    got = [scheduled_difficulty(section, s) for s in (1, 2, 3, 4, 9, 16, 40)]
    assert got == [24, 24, 32, 40, 56, 72, 72]


def test_fixed_discrete_by_hand() -> None:
    assert _updates(DISCRETE, 8) == [16, 16, 16, 32, 32, 32, 64, 64]


def test_custom_schedule_and_its_errors() -> None:
    raw = _legacy("custom", 8, 40)
    assert _updates(raw, 6, custom=lambda s: 8 * s) == [8, 16, 24, 32, 40, 40]
    with pytest.raises(ConfigError, match="set_custom_curriculum_learning_schedule"):
        _updates(raw, 1)
    with pytest.raises(ConfigError, match="must return an int"):
        _updates(raw, 1, custom=lambda s: 8.5)


def test_never_below_min_difficulty() -> None:
    # min 8 with difficulty_step 16: step 1 gives floor(13.6) = 13, rounded down to 0; the
    # floor is the first multiple of 16 at or above 8
    raw = _legacy("fixed_linear", 8, 64, total_curriculum_step=10, difficulty_step=16)
    sequence = _updates(raw, 10)
    assert sequence[0] == 16 and min(sequence) >= 8 and sequence[-1] == 64


def _deepspeed_scheduler() -> Any:
    try:
        from deepspeed.runtime.data_pipeline.curriculum_scheduler import CurriculumScheduler
    except Exception as error:  # DeepSpeed is in the bench group only
        pytest.skip(f"DeepSpeed is not importable ({error}); uv sync --group bench")
    return CurriculumScheduler


CASES = [
    LINEAR,
    ROOT,
    DISCRETE,
    _legacy("fixed_linear", 8, 64, total_curriculum_step=10, difficulty_step=16),
    _legacy("fixed_linear", 64, 1024, total_curriculum_step=37, difficulty_step=8),
    _legacy("fixed_root", 80, 2048, total_curriculum_step=100, difficulty_step=16, root_degree=3),
    _legacy("fixed_root", 5, 30, total_curriculum_step=7, difficulty_step=1, root_degree=1),
    _legacy("fixed_discrete", 1, 3, difficulty=[1, 2, 3], max_step=[5, 10]),
    _legacy("custom", 8, 200),
]


@pytest.mark.parametrize("raw", CASES, ids=lambda raw: raw["schedule_type"])
def test_sequences_equal_deepspeeds(raw: dict[str, Any]) -> None:
    deepspeed_class = _deepspeed_scheduler()
    theirs = deepspeed_class(copy.deepcopy(raw))
    custom = (lambda s: 8 + 3 * s) if raw["schedule_type"] == "custom" else None
    if custom is not None:
        theirs.set_custom_get_difficulty(custom)
    steps = 2 * int(raw["schedule_config"].get("total_curriculum_step", 12)) + 3
    expected = [theirs.update_difficulty(step) for step in range(1, steps + 1)]
    assert _updates(raw, steps, custom=custom) == expected


def test_state_dict_round_trip() -> None:
    scheduler = CurriculumScheduler(LegacyCurriculumConfig(enabled=True, **LINEAR))
    scheduler.update(5)
    state = scheduler.state_dict()
    other = CurriculumScheduler(LegacyCurriculumConfig(enabled=True, **LINEAR))
    other.load_state_dict(state)
    assert other.difficulty == scheduler.difficulty == 32
    with pytest.raises(ConfigError, match="current_difficulty"):
        other.load_state_dict({"current_difficulty": "32"})


def test_truncation_cuts_sequence_tensors_only() -> None:
    ids = torch.arange(20).reshape(2, 10)
    mask4 = torch.ones(2, 1, 10, 10)
    args, kwargs = truncate_to_seqlen(
        ({"input_ids": ids, "other": ids},),
        {"labels": ids, "attention_mask": mask4, "features": ids},
        4,
    )
    assert torch.equal(args[0]["input_ids"], ids[:, :4])
    assert torch.equal(args[0]["other"], ids) and torch.equal(kwargs["features"], ids)
    assert torch.equal(kwargs["labels"], ids[:, :4])
    assert kwargs["attention_mask"].shape == (2, 1, 4, 4)


def test_what_the_engine_refuses() -> None:
    metric = {**LINEAR, "index_to_sample_path": "idx"}
    efficiency = {
        "enabled": True,
        "data_sampling": {
            "enabled": True,
            "curriculum_learning": {"enabled": True, "curriculum_metrics": {"seqlen": metric}},
        },
    }
    config = DeepShardConfig.from_dict(
        {
            "train_batch_size": 2,
            "curriculum_learning": {"enabled": True, **LINEAR},
            "data_efficiency": efficiency,
        }
    )
    with pytest.raises(ConfigError) as error:
        check_engine_config(config)
    text = str(error.value)
    assert "curriculum_learning.enabled: both the legacy curriculum" in text
    assert "curriculum_metrics.seqlen.index_to_sample_path: index-based" in text
