"""Progress lines reach rank 0's stderr with no logging set-up, once, and stay off rank 1.

One ``run_on_mesh`` call on 2 gloo ranks; each rank process configures no logging. Each rank
points ``sys.stderr``/``sys.stdout`` at a buffer and trains a tiny model through four phases, in
this order (the logging state carries over from one to the next, as in one training script):

1. nothing configured: rank 0 shows the progress, wall-clock and memory lines and the two
   ignored-settings warnings; rank 1 shows none of them;
2. ``"log_level": "warning"``: the progress lines disappear, the warnings stay;
3. ``DEEPSHARD_LOG_ALL_RANKS=1``: rank 1 prints its own progress line too;
4. the application puts a handler on ``deepshard.engine``: the lines go there, not to stderr;
5. the application calls ``logging.basicConfig`` (after DeepShard added its handler): each
   line appears exactly once.
"""

from __future__ import annotations

import io
from typing import Any

import pytest

from deepshard.testing import run_on_mesh

pytestmark = pytest.mark.slow  # the main run covers it; the package env keeps a few lighter ones

_CONFIG: dict[str, Any] = {
    "train_batch_size": 4,
    "steps_per_print": 1,
    "wall_clock_breakdown": True,
    "memory_breakdown": True,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
    "tensorboard": {"enabled": True, "output_path": "unused"},
    "timers": {"throughput": {"synchronized": False}},
}


def _train(extra: dict[str, Any], mesh: Any) -> str:
    import sys

    import torch

    import deepshard.engine as ds

    buffer = io.StringIO()
    saved = sys.stdout, sys.stderr
    sys.stdout = sys.stderr = buffer
    try:
        model = torch.nn.Linear(4, 2)
        engine, _, _, _ = ds.initialize(model, {**_CONFIG, **extra}, mesh=mesh)
        for _ in range(2):
            engine.backward(engine(torch.ones(2, 4)).square().mean())
            engine.step()
    finally:
        sys.stdout, sys.stderr = saved
    return buffer.getvalue()


def _phases(mesh: Any) -> dict[str, str]:
    import logging
    import os

    out = {"nothing": _train({}, mesh), "warning": _train({"log_level": "warning"}, mesh)}
    os.environ["DEEPSHARD_LOG_ALL_RANKS"] = "1"
    out["all ranks"] = _train({"log_level": "info"}, mesh)
    del os.environ["DEEPSHARD_LOG_ALL_RANKS"]
    child = logging.StreamHandler(io.StringIO())
    logging.getLogger("deepshard.engine").addHandler(child)
    out["child handler: stderr"] = _train({}, mesh)
    logging.getLogger("deepshard.engine").removeHandler(child)
    out["child handler"] = child.stream.getvalue()
    buffer = io.StringIO()
    logging.basicConfig(level=logging.INFO, stream=buffer)
    _train({}, mesh)
    out["basicConfig"] = buffer.getvalue()
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, str]]:
    return run_on_mesh(_phases, 2, store_dir=tmp_path_factory.mktemp("logs"), timeout_s=120)


def _count(text: str, needle: str) -> int:
    return sum(needle in line for line in text.splitlines())


STEPS = 2  # _train's steps, each printing (steps_per_print 1)
# Needle -> lines expected: one progress line per step; a wall-clock and a memory line each.
PROGRESS = {
    "step 1 | loss": 1,
    "step 2 | loss": 1,
    "time per step (ms)": STEPS,
    "tensor bytes:": STEPS,
}
WARNINGS = {"accepted but not active yet": 1, "ignored config keys:": 1}


def _counts(text: str, expected: dict[str, int]) -> dict[str, int]:
    return {needle: _count(text, needle) for needle in expected}


def test_rank0_shows_progress_and_warnings_without_logging_set_up(ranks: list[Any]) -> None:
    text = ranks[0]["nothing"]
    assert _counts(text, PROGRESS | WARNINGS) == PROGRESS | WARNINGS, text
    assert "[rank 0] [INFO] deepshard.engine: step 1 | loss" in text


def test_rank1_stays_silent(ranks: list[Any]) -> None:
    assert ranks[1]["nothing"] == ""
    assert ranks[1]["warning"] == ""


def test_the_warning_lists_each_inert_block_and_every_ignored_key(ranks: list[Any]) -> None:
    features = next(x for x in ranks[0]["nothing"].splitlines() if "accepted but not" in x)
    assert "tensorboard: the TensorBoard monitor" in features
    assert "timers: throughput timers" in features
    keys = next(x for x in ranks[0]["nothing"].splitlines() if "ignored config keys:" in x)
    assert keys.split("ignored config keys: ")[1].split(", ") == [  # in the schema's order
        "timers.throughput.synchronized",
        "tensorboard.enabled",
        "tensorboard.output_path",
    ]


def test_log_level_warning_hides_progress_but_not_warnings(ranks: list[Any]) -> None:
    text = ranks[0]["warning"]
    assert _counts(text, PROGRESS) == dict.fromkeys(PROGRESS, 0), text
    assert _counts(text, WARNINGS) == WARNINGS, text


def test_every_rank_prints_its_progress_when_asked(ranks: list[Any]) -> None:
    assert _count(ranks[0]["all ranks"], "[rank 0] [INFO] deepshard.engine: step 1 | loss") == 1
    assert _count(ranks[1]["all ranks"], "[rank 1] [INFO] deepshard.engine: step 1 | loss") == 1
    assert _counts(ranks[1]["all ranks"], WARNINGS) == dict.fromkeys(WARNINGS, 0)  # rank 0's


def test_each_line_once_when_the_application_configured_logging(ranks: list[Any]) -> None:
    text = ranks[0]["basicConfig"]
    assert _counts(text, PROGRESS | WARNINGS) == PROGRESS | WARNINGS, text
    assert "[rank 0]" not in text  # the application's format, not DeepShard's handler
    assert ranks[1]["basicConfig"] == ""


def test_a_handler_on_a_child_logger_takes_the_lines_alone(ranks: list[Any]) -> None:
    assert _counts(ranks[0]["child handler"], PROGRESS | WARNINGS) == PROGRESS | WARNINGS
    assert ranks[0]["child handler: stderr"] == ""


def test_a_bad_switch_value_is_a_config_error() -> None:
    from deepshard.engine._logging import log_all_ranks
    from deepshard.interface import ConfigError

    assert log_all_ranks({"DEEPSHARD_LOG_ALL_RANKS": "Yes"}) is True
    assert log_all_ranks({}) is False
    with pytest.raises(ConfigError, match="DEEPSHARD_LOG_ALL_RANKS='2'"):
        log_all_ranks({"DEEPSHARD_LOG_ALL_RANKS": "2"})
