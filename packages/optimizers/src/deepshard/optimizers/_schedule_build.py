"""`build_scheduler`: the schedule a ``scheduler`` config section names, or a clear error.

DeepSpeed's names come first (as in DeepSpeed's engine); any other name is looked up in
``torch.optim.lr_scheduler``. Parameters are checked against the class's signature before
anything is built, so a typo names its key (``scheduler.params.warmup_num_step``) and the
accepted ones instead of surfacing as a ``TypeError``.
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from deepshard.interface.config import SchedulerConfig
from deepshard.interface.errors import ConfigError
from deepshard.optimizers._schedule_base import LRSchedule, ParamGroupOwner
from deepshard.optimizers._schedule_cycle import LRRangeTest, OneCycle
from deepshard.optimizers._schedule_torch import (
    REFUSED_TORCH_SCHEDULES,
    TorchSchedule,
    callable_params,
    torch_schedule_classes,
)
from deepshard.optimizers._schedule_warmup import WarmupCosineLR, WarmupDecayLR, WarmupLR

__all__ = ["DEEPSPEED_SCHEDULES", "build_scheduler"]

DEEPSPEED_SCHEDULES: Mapping[str, type[LRSchedule]] = {
    "WarmupLR": WarmupLR,
    "WarmupDecayLR": WarmupDecayLR,
    "WarmupCosineLR": WarmupCosineLR,
    "OneCycle": OneCycle,
    "LRRangeTest": LRRangeTest,
}
"""DeepSpeed's schedule names and the classes that implement them."""


def build_scheduler(config: SchedulerConfig, optimizer: ParamGroupOwner) -> LRSchedule:
    """Builds the learning-rate schedule that `config` names, on `optimizer`.

    Args:
        config: The ``scheduler`` section: ``type`` (a DeepSpeed schedule name such as
            ``"WarmupLR"``, or a ``torch.optim.lr_scheduler`` class name) and ``params``.
        optimizer: The optimizer whose param groups the schedule sets. A torch schedule needs a
            ``torch.optim.Optimizer``; DeepSpeed's accept anything with ``param_groups``.

    Returns:
        The schedule, written into the optimizer already at its start position. Call
        ``step()`` once per applied optimizer step.

    Raises:
        ConfigError: On an unknown type (key ``scheduler.type``, listing the known ones) or an
            unknown, missing or invalid parameter (key ``scheduler.params.<name>``).
        TypeError: If a torch schedule is asked for on something that is not a torch optimizer.
    """
    name, params = config.type, dict(config.params)
    if name in DEEPSPEED_SCHEDULES:
        cls = DEEPSPEED_SCHEDULES[name]
        _check_param_names(name, cls, params)
        try:
            return cls(optimizer, **params)  # type: ignore[call-arg]
        except ConfigError as exc:
            raise _under_params(exc) from exc
    torch_classes = torch_schedule_classes()
    if name in torch_classes:
        return _build_torch(name, torch_classes[name], params, optimizer)
    if name in REFUSED_TORCH_SCHEDULES:
        message = f"torch.optim.lr_scheduler.{name} {REFUSED_TORCH_SCHEDULES[name]}"
        raise ConfigError.from_problems([("scheduler.type", message)])
    known = [*DEEPSPEED_SCHEDULES, *sorted(torch_classes)]
    raise ConfigError.from_problems(
        [("scheduler.type", f"unknown schedule {name!r}{_suggest(name, known)}; known: {known}")]
    )


def _build_torch(
    name: str,
    cls: type[torch.optim.lr_scheduler.LRScheduler],
    params: dict[str, Any],
    optimizer: ParamGroupOwner,
) -> TorchSchedule:
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"torch.optim.lr_scheduler.{name} needs a torch.optim.Optimizer, got "
            f"{type(optimizer).__name__}; use one of DeepSpeed's schedules or pass the torch "
            "optimizer itself"
        )
    _check_param_names(name, cls, params, refused=callable_params(cls))
    try:
        return TorchSchedule(cls(optimizer, **params))
    except (TypeError, ValueError, KeyError, ZeroDivisionError) as exc:
        message = f"torch.optim.lr_scheduler.{name} refused them: {exc}"
        raise ConfigError.from_problems([("scheduler.params", message)]) from exc


def _check_param_names(
    name: str, cls: type, params: dict[str, Any], refused: Iterable[str] = ()
) -> None:
    """Refuses unknown and missing parameters, each under its own key."""
    signature = inspect.signature(cls).parameters
    accepted = [key for key in signature if key != "optimizer"]
    refused = set(refused)
    problems: list[tuple[str, str]] = []
    for key in params:
        path = f"scheduler.params.{key}"
        if key == "optimizer":
            problems.append((path, "is filled in with the engine's optimizer; remove it"))
        elif key not in accepted:
            hint = _suggest(key, accepted)
            problems.append((path, f"is not a parameter of {name}{hint}; accepted: {accepted}"))
        elif key in refused:
            problems.append((path, "takes a Python callable, which JSON cannot express; remove it"))
    for key in accepted:
        if signature[key].default is inspect.Parameter.empty and key not in params:
            problems.append((f"scheduler.params.{key}", f"is required by {name}; add it"))
    if problems:
        raise ConfigError.from_problems(problems)


def _under_params(exc: ConfigError) -> ConfigError:
    """The same problems, keyed under ``scheduler.params``."""
    problems = exc.problems or [("", str(exc))]
    return ConfigError.from_problems(
        [(f"scheduler.params.{key}" if key else "scheduler.params", msg) for key, msg in problems]
    )


def _suggest(word: str, choices: list[str]) -> str:
    by_case = [choice for choice in choices if choice.lower() == word.lower()]
    close = by_case or difflib.get_close_matches(word, choices, n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""
