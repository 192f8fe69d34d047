"""Curriculum learning: a difficulty (usually the sequence length) that grows with the step.

Both of DeepSpeed's curriculum configs work: the legacy top-level ``curriculum_learning``
section (one schedule, ``curriculum_type: "seqlen"``) and
``data_efficiency.data_sampling.curriculum_learning`` (one schedule per named metric). A
`CurriculumScheduler` holds one schedule's current difficulty; the difficulty for global step
``s`` is, as DeepSpeed documents:

* ``fixed_linear``: ``min + (max - min) · s / total_curriculum_step``, floored, rounded down to a
  multiple of ``difficulty_step``;
* ``fixed_root``: the same with ``(s / total_curriculum_step) ** (1 / root_degree)``;
* ``fixed_discrete``: ``difficulty[i]`` for the first ``i`` with ``s <= max_step[i]``, the last
  difficulty after the last ``max_step``;
* ``custom``: a function of the step the script sets
  (``engine.set_custom_curriculum_learning_schedule(fn)``).

The linear and root curves never go below ``min_difficulty`` (rounded up to a multiple of
``difficulty_step``; DeepSpeed 0.19.7's fix, before which ``min 8, step 16`` began at 0) nor
above ``max_difficulty``. Once the maximum is reached the schedule stops updating.

The engine steps every schedule before each training forward with ``global_steps + 1`` (the
step the forward belongs to, as DeepSpeed's engine does) and, for a sequence-length schedule
(legacy ``curriculum_type: "seqlen"``, or a metric named ``seqlen``/``seqlen_truncate``), cuts
the batch's ``input_ids``, ``labels``, masks and ids to that length
(`truncate_to_seqlen`). Other metrics are read with ``engine.curriculum_difficulty(name)`` by
the script's own sampler. The state (`CurriculumScheduler.state_dict`) is JSON data.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import torch

from deepshard.interface.config import (
    CurriculumMetricConfig,
    DeepShardConfig,
    LegacyCurriculumConfig,
)
from deepshard.interface.errors import ConfigError

__all__ = [
    "SEQLEN_METRICS",
    "SEQUENCE_KEYS",
    "CurriculumScheduler",
    "curriculum_problems",
    "curriculum_schedulers",
    "scheduled_difficulty",
    "truncate_to_seqlen",
]

CurriculumSection = LegacyCurriculumConfig | CurriculumMetricConfig

SEQLEN_METRICS = frozenset({"seqlen", "seqlen_truncate"})
"""Data-efficiency metric names whose difficulty is the sequence length the engine cuts to."""

SEQUENCE_KEYS = (
    "input_ids",
    "labels",
    "attention_mask",
    "position_ids",
    "token_type_ids",
    "loss_mask",
)
"""Keyword arguments (or keys of a dict batch) cut along the sequence dimension (dim 1)."""

LEGACY = "curriculum_learning"
"""The key of the legacy schedule among `curriculum_schedulers`' results."""


def scheduled_difficulty(
    section: CurriculumSection, step: int, custom: Callable[[int], int] | None = None
) -> int:
    """The difficulty a schedule gives global step ``step`` (a pure function).

    Args:
        section: The schedule (legacy section or one data-efficiency metric).
        step: The global step.
        custom: The schedule function of a ``custom`` schedule.

    Raises:
        ConfigError: A ``custom`` schedule without a function, or one returning a non-integer.
    """
    schedule, low, high = section.schedule_config, section.min_difficulty, section.max_difficulty
    assert low is not None and high is not None  # the section's validator requires them
    if section.schedule_type == "fixed_discrete":
        levels, ends = schedule.difficulty or [], schedule.max_step or []
        return next(
            (lvl for lvl, end in zip(levels, ends, strict=False) if step <= end), levels[-1]
        )
    if section.schedule_type == "custom":
        if custom is None:
            raise ConfigError(
                "curriculum schedule_type 'custom' needs a schedule function: call "
                "engine.set_custom_curriculum_learning_schedule(fn) before the first forward"
            )
        value = custom(step)
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(
                f"the custom curriculum schedule returned {value!r} for step {step}; it must "
                "return an int difficulty"
            )
        return value
    total, quantum = schedule.total_curriculum_step, schedule.difficulty_step
    assert total is not None and quantum is not None
    degree = schedule.root_degree if section.schedule_type == "fixed_root" else 1
    assert degree is not None
    fraction: float = (float(step) / total) ** (1.0 / degree)
    raw = math.floor(fraction * (high - low) + low)
    raw -= raw % quantum
    return min(max(raw, -(-low // quantum) * quantum), high)


class CurriculumScheduler:
    """One schedule's current difficulty, stepped with the global step.

    Args:
        section: The schedule's config.
        name: ``"curriculum_learning"`` for the legacy section, else the metric's name.
    """

    def __init__(self, section: CurriculumSection, name: str = LEGACY) -> None:
        if section.min_difficulty is None:
            raise ConfigError(f"{name}.min_difficulty: required when the curriculum is enabled")
        self.section = section
        self.name = name
        self.difficulty: int = section.min_difficulty
        """The current difficulty (``min_difficulty`` until the first update)."""
        self.custom: Callable[[int], int] | None = None
        """The ``custom`` schedule's function."""

    @property
    def is_seqlen(self) -> bool:
        """Whether the difficulty is a sequence length the engine truncates batches to."""
        section = self.section
        if isinstance(section, LegacyCurriculumConfig):
            return section.curriculum_type == "seqlen"
        return self.name in SEQLEN_METRICS

    def update(self, step: int) -> int:
        """Move to global step ``step``'s difficulty (no change once at the maximum)."""
        high = self.section.max_difficulty
        if high is None or self.difficulty < high:
            self.difficulty = scheduled_difficulty(self.section, step, self.custom)
        return self.difficulty

    def state_dict(self) -> dict[str, Any]:
        """The current difficulty (JSON data; the schedule itself comes from the config)."""
        return {"current_difficulty": self.difficulty}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore `state_dict`'s difficulty.

        Raises:
            ConfigError: ``state`` has no integer ``current_difficulty``.
        """
        value = state.get("current_difficulty")
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(
                f"curriculum state for {self.name!r}: expected an int 'current_difficulty', "
                f"got {value!r}; pass what state_dict() returned"
            )
        self.difficulty = value


def curriculum_problems(config: DeepShardConfig) -> list[tuple[str, str]]:
    """``(key, problem)`` for curriculum settings the engine cannot run as asked."""
    problems = []
    sampling = config.data_efficiency.data_sampling
    metrics = sampling.curriculum_learning
    new = config.data_efficiency.enabled and sampling.enabled and metrics.enabled
    if config.curriculum_learning.enabled and new:
        problems.append(
            (
                "curriculum_learning.enabled",
                "both the legacy curriculum and data_efficiency's are enabled; keep one",
            )
        )
    prefix = "data_efficiency.data_sampling.curriculum_learning"
    if new and metrics.data_cluster_path is not None:
        problems.append(
            (
                f"{prefix}.data_cluster_path",
                "index-based curriculum sampling (clusters from the data analyzer) is not "
                "available; remove it and sample by engine.curriculum_difficulty(metric)",
            )
        )
    for name, metric in metrics.curriculum_metrics.items() if new else ():
        for key in ("index_to_sample_path", "index_to_metric_path"):
            if getattr(metric, key) is not None:
                problems.append(
                    (
                        f"{prefix}.curriculum_metrics.{name}.{key}",
                        "index-based curriculum sampling is not available; remove it and "
                        "sample by engine.curriculum_difficulty(metric) in your own sampler",
                    )
                )
    return problems


def curriculum_schedulers(config: DeepShardConfig) -> dict[str, CurriculumScheduler]:
    """Every enabled schedule by name (`LEGACY` for the legacy section), empty when none."""
    if config.curriculum_learning.enabled:
        return {LEGACY: CurriculumScheduler(config.curriculum_learning)}
    efficiency = config.data_efficiency
    metrics = efficiency.data_sampling.curriculum_learning
    if not (efficiency.enabled and efficiency.data_sampling.enabled and metrics.enabled):
        return {}
    return {name: CurriculumScheduler(m, name) for name, m in metrics.curriculum_metrics.items()}


def _cut(name: str, value: Any, seqlen: int) -> Any:
    if not isinstance(value, torch.Tensor) or value.dim() < 2:
        return value
    if name == "attention_mask" and value.dim() == 4:  # (batch, heads, query, key)
        return value[..., :seqlen, :seqlen]
    return value[:, :seqlen]


def truncate_to_seqlen(
    args: tuple[Any, ...], kwargs: dict[str, Any], seqlen: int
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The forward's arguments with every `SEQUENCE_KEYS` tensor cut to ``seqlen`` tokens.

    Keyword arguments of those names are cut, and so are those keys of a dict passed
    positionally (``engine(batch)``); a 2-D tensor along dim 1, a 4-D ``attention_mask`` along
    its last two. Other arguments pass unchanged, and so does a batch shorter than ``seqlen``.
    """
    cut_kwargs = {k: _cut(k, v, seqlen) if k in SEQUENCE_KEYS else v for k, v in kwargs.items()}
    cut_args = tuple(
        {k: _cut(k, v, seqlen) if k in SEQUENCE_KEYS else v for k, v in arg.items()}
        if isinstance(arg, dict)
        else arg
        for arg in args
    )
    return cut_args, cut_kwargs
