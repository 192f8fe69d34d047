"""DeepSpeed's schedule tuning flags (``--lr_schedule``, ``--warmup_*``, ``--cycle_*`` ...).

`add_schedule_arguments` adds DeepSpeed's flags (``add_tuning_arguments``) to a parser and
`schedule_config_from_args` writes the given ones into the config's ``scheduler`` section:

* ``--lr_schedule TYPE`` chooses the schedule; a type other than the config's starts from no
  params, the config's own type keeps its params and the flags override them;
* every other flag is written to ``scheduler.params`` under its own name, but only when it
  was given (the flags default to None): an absent flag leaves the config's value, or the
  schedule's default. DeepSpeed instead writes its argparse defaults, some of which its own
  OneCycle cannot use (stair counts of -1);
* the WarmupCosineLR ratios ``--warmup_min_ratio`` / ``--cos_min_ratio`` reach the config
  (DeepSpeed 0.19.7's fix), and ``--total_num_steps`` (not a DeepSpeed flag) completes
  WarmupDecayLR/WarmupCosineLR, which cannot run without it;
* ``--lr_range_test_staircase`` is an explicit optional flag (``--no-lr_range_test_staircase``
  too), off by default;
* a flag the schedule does not take (``--cycle_min_lr`` with WarmupLR) is an error naming it,
  where DeepSpeed drops it silently. OneCycle's required bounds default to DeepSpeed's flag
  values (0.01 and 0.1) when neither the config nor the command line gives them.
"""

from __future__ import annotations

import argparse
import copy
from collections.abc import Mapping
from typing import Any, overload

from deepshard.interface.config import DeepShardConfig, SchedulerConfig
from deepshard.interface.errors import ConfigError

__all__ = ["SCHEDULE_FLAGS", "add_schedule_arguments", "schedule_config_from_args"]

_WARMUP = ("warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type")
_CYCLE = (
    "cycle_first_step_size",
    "cycle_first_stair_count",
    "cycle_second_step_size",
    "cycle_second_stair_count",
    "decay_step_size",
    "cycle_min_lr",
    "cycle_max_lr",
    "decay_lr_rate",
    "cycle_momentum",
    "cycle_min_mom",
    "cycle_max_mom",
    "decay_mom_rate",
)

SCHEDULE_FLAGS: Mapping[str, tuple[str, ...]] = {
    "LRRangeTest": (
        "lr_range_test_min_lr",
        "lr_range_test_step_rate",
        "lr_range_test_step_size",
        "lr_range_test_staircase",
    ),
    "OneCycle": _CYCLE,
    "WarmupLR": _WARMUP,
    "WarmupDecayLR": (*_WARMUP, "total_num_steps"),
    "WarmupCosineLR": (
        "warmup_num_steps",
        "warmup_type",
        "warmup_min_ratio",
        "cos_min_ratio",
        "total_num_steps",
    ),
}
"""The flags (= ``scheduler.params`` keys) each DeepSpeed schedule takes."""

_REQUIRED_DEFAULTS = {"OneCycle": {"cycle_min_lr": 0.01, "cycle_max_lr": 0.1}}

# (flag, type, help); every flag defaults to None so that "given" can be told from "absent"
_FLAGS: tuple[tuple[str, type, str], ...] = (
    ("lr_range_test_min_lr", float, "LRRangeTest: starting lr"),
    ("lr_range_test_step_rate", float, "LRRangeTest: scaling rate"),
    ("lr_range_test_step_size", int, "LRRangeTest: training steps per lr change"),
    ("cycle_first_step_size", int, "OneCycle: size of the first step (training steps)"),
    ("cycle_first_stair_count", int, "OneCycle: first stair count"),
    ("cycle_second_step_size", int, "OneCycle: size of the second step"),
    ("cycle_second_stair_count", int, "OneCycle: second stair count"),
    ("decay_step_size", int, "OneCycle: interval of the post-cycle decay (training steps)"),
    ("cycle_min_lr", float, "OneCycle: lr lower bound"),
    ("cycle_max_lr", float, "OneCycle: lr upper bound"),
    ("decay_lr_rate", float, "OneCycle: post-cycle lr decay rate"),
    ("cycle_min_mom", float, "OneCycle: momentum lower bound"),
    ("cycle_max_mom", float, "OneCycle: momentum upper bound"),
    ("decay_mom_rate", float, "OneCycle: post-cycle momentum decay rate"),
    ("warmup_min_lr", float, "WarmupLR/WarmupDecayLR: initial lr"),
    ("warmup_max_lr", float, "WarmupLR/WarmupDecayLR: lr after warm-up"),
    ("warmup_num_steps", int, "warm-up steps"),
    ("warmup_type", str, "warm-up curve: log or linear"),
    ("warmup_min_ratio", float, "WarmupCosineLR: initial lr as a ratio of the optimizer's"),
    ("cos_min_ratio", float, "WarmupCosineLR: final lr as a ratio of the optimizer's"),
    ("total_num_steps", int, "WarmupDecayLR/WarmupCosineLR: total training steps"),
)


def add_schedule_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add DeepSpeed's schedule tuning flags (its ``add_tuning_arguments``) to ``parser``.

    Args:
        parser: The script's parser.

    Returns:
        ``parser``, with a "Convergence Tuning" argument group.
    """
    group = parser.add_argument_group("Convergence Tuning", "learning-rate schedule flags")
    group.add_argument(
        "--lr_schedule", choices=sorted(SCHEDULE_FLAGS), default=None, help="LR schedule type"
    )
    for name, kind, text in _FLAGS:
        group.add_argument(f"--{name}", type=kind, default=None, help=f"{text} (if given)")
    for name, text in (
        ("lr_range_test_staircase", "LRRangeTest: staircase scaling (off by default)"),
        ("cycle_momentum", "OneCycle: cycle the momentum too"),
    ):
        group.add_argument(
            f"--{name}", action=argparse.BooleanOptionalAction, default=None, help=text
        )
    return parser


def _given(args: argparse.Namespace) -> dict[str, Any]:
    names = [name for name, _, _ in _FLAGS] + ["lr_range_test_staircase", "cycle_momentum"]
    return {n: getattr(args, n) for n in names if getattr(args, n, None) is not None}


def _scheduler(args: argparse.Namespace, current: Mapping[str, Any] | None) -> dict[str, Any]:
    flags = _given(args)
    chosen = getattr(args, "lr_schedule", None)
    if chosen is None and current is None:
        if not flags:
            return {}
        raise ConfigError(
            f"--{next(iter(flags))} was given but the config has no scheduler; add "
            "--lr_schedule (one of " + ", ".join(sorted(SCHEDULE_FLAGS)) + ")"
        )
    kind = chosen if chosen is not None else str(current["type"]) if current else ""
    same = current is not None and current.get("type") == kind
    params = dict(current.get("params", {})) if same and current is not None else {}
    accepted = SCHEDULE_FLAGS.get(kind, ())
    wrong = [f"--{name}" for name in flags if name not in accepted]
    if wrong:
        raise ConfigError(
            f"{', '.join(wrong)}: not a parameter of the {kind} schedule (it takes "
            f"{', '.join('--' + n for n in accepted) or 'none of these flags'}); drop them"
        )
    params.update(flags)
    for key, value in _REQUIRED_DEFAULTS.get(kind, {}).items():
        params.setdefault(key, value)
    return {"type": kind, "params": params}


@overload
def schedule_config_from_args(
    args: argparse.Namespace, config: DeepShardConfig
) -> DeepShardConfig: ...
@overload
def schedule_config_from_args(
    args: argparse.Namespace, config: Mapping[str, Any] | None = None
) -> dict[str, Any]: ...
def schedule_config_from_args(
    args: argparse.Namespace, config: Mapping[str, Any] | DeepShardConfig | None = None
) -> dict[str, Any] | DeepShardConfig:
    """The config with the schedule flags given on the command line written into ``scheduler``.

    Args:
        args: Parsed arguments from a parser `add_schedule_arguments` extended.
        config: A DeepSpeed config dict (copied, never changed) or a `DeepShardConfig`;
            None for a dict holding only the scheduler.

    Returns:
        A new config of the same kind (a dict for None), unchanged when no flag was given.

    Raises:
        ConfigError: A flag the schedule does not take, flags without any schedule, or
            parameters the schedule section refuses.
    """
    if isinstance(config, DeepShardConfig):
        current = config.scheduler.model_dump() if config.scheduler is not None else None
        section = _scheduler(args, current)
        if not section:
            return config
        return config.model_copy(update={"scheduler": SchedulerConfig(**section)})
    result = copy.deepcopy(dict(config or {}))
    section = _scheduler(args, result.get("scheduler"))
    if section:
        SchedulerConfig(**section)  # refuse bad values here, naming the section
        result["scheduler"] = section
    return result
