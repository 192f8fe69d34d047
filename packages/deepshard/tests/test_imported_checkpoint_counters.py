"""``load_checkpoint`` of a tag ``ds-checkpoint import-deepspeed`` wrote restores DeepSpeed's
counters (no processes: `restore_imported` on the engine's accumulation counters alone); the
end-to-end resume is ``integration_tests/test_resume_after_deepspeed_import.py``."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from deepshard.engine._accumulation import GradientAccumulation
from deepshard.engine._engine_json import restore_imported
from deepshard.interface.errors import CheckpointError


def _engine(accumulation_steps: int) -> Any:
    accumulation = GradientAccumulation(accumulation_steps, train_batch_size=8)
    return SimpleNamespace(parts=SimpleNamespace(accumulation=accumulation))


def test_deepspeed_counters_come_back_at_a_boundary() -> None:
    engine = _engine(accumulation_steps=4)
    restore_imported(engine, {"global_steps": 3, "global_samples": 24, "skipped_steps": 1})
    counters = engine.parts.accumulation
    assert (counters.global_steps, counters.global_samples, counters.skipped_steps) == (3, 24, 1)
    assert counters.micro_steps == 12  # DeepSpeed saves none: 3 boundaries of 4 micro-steps
    assert not counters.is_boundary()  # the next step() starts a fresh accumulation cycle


_MISSING = {"global_samples": 24, "skipped_steps": 0}
_NOT_A_NUMBER = {"global_steps": "x", "global_samples": 1, "skipped_steps": 0}


@pytest.mark.parametrize("saved", [_MISSING, _NOT_A_NUMBER])
def test_a_missing_or_bad_counter_is_refused_by_name(saved: dict[str, Any]) -> None:
    with pytest.raises(CheckpointError, match="import it again"):
        restore_imported(_engine(1), saved)
