"""`optimizer` and `scheduler`: which optimizer and LR schedule to build, by name, with params.

The ``params`` dictionaries stay free-form here, as in DeepSpeed: their keys depend on the type
(``lr``, ``betas``, ``weight_decay`` for Adam; ``warmup_num_steps`` for WarmupLR; ...), and the
optimizer and scheduler builders in ``deepshard.optimizers`` validate them against the type.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, field_validator

from deepshard.interface.config._base import ConfigModel, raw_problems_error
from deepshard.interface.config._removed import HF_AUTO_MESSAGE, refused_optimizer_message

__all__ = ["OptimizerConfig", "SchedulerConfig"]


def _auto_placeholders(value: Any, path: str) -> list[tuple[str, str]]:
    if isinstance(value, dict):
        return [p for k, v in value.items() for p in _auto_placeholders(v, f"{path}.{k}")]
    if isinstance(value, list):
        return [p for i, v in enumerate(value) for p in _auto_placeholders(v, f"{path}[{i}]")]
    return [(path, HF_AUTO_MESSAGE)] if value == "auto" else []


def _refuse_auto(params: dict[str, Any]) -> dict[str, Any]:
    problems = _auto_placeholders(params, "params")
    if problems:
        raise raw_problems_error([(path.removeprefix("params."), m) for path, m in problems])
    return params


class OptimizerConfig(ConfigModel):
    """The `optimizer` section: the optimizer type and its constructor arguments."""

    config_key = "optimizer"

    type: str = Field(min_length=1)
    """Optimizer name as written, case preserved (``"AdamW"``, ``"Adam"``, ``"Lion"``, ``"Muon"``);
    the builder matches it case-insensitively."""

    params: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments for the optimizer, e.g. ``{"lr": 3e-4, "betas": [0.9, 0.95]}``.
    Free-form here; the optimizer builder checks them against the type."""

    legacy_fusion: bool = False
    """DeepSpeed's switch for the old fused fp16 optimizer path; kept for compatibility."""

    @field_validator("type")
    @classmethod
    def _refuse_removed(cls, value: str) -> str:
        message = refused_optimizer_message(value)
        if message:
            raise raw_problems_error([("", message)])
        return value

    @field_validator("params")
    @classmethod
    def _no_placeholders(cls, value: dict[str, Any]) -> dict[str, Any]:
        return _refuse_auto(value)


class SchedulerConfig(ConfigModel):
    """The `scheduler` section: the learning-rate schedule type and its arguments."""

    config_key = "scheduler"

    type: str = Field(min_length=1)
    """Schedule name as written (``"WarmupLR"``, ``"WarmupDecayLR"``, ``"WarmupCosineLR"``,
    ``"OneCycle"``, ``"LRRangeTest"``); validated by the scheduler builder."""

    params: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments of the schedule, e.g. ``{"warmup_num_steps": 1000}``; free-form here."""

    @field_validator("params")
    @classmethod
    def _no_placeholders(cls, value: dict[str, Any]) -> dict[str, Any]:
        return _refuse_auto(value)
