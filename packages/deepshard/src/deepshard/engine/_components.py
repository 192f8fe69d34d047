"""Which optimizer and LR schedule a run uses: the caller's, or the config's.

As in DeepSpeed, what the caller passes to ``initialize`` wins over the config: an optimizer
object or a callable that builds one from the parameters, a schedule object or a callable that
builds one from the (ZeRO-wrapped) optimizer. The config's ``optimizer`` and ``scheduler``
sections are used only when the caller passes nothing; a section the caller overrides is
ignored with a warning.

A config naming Muon gets the module's parameter names along with ``model_parameters``, so
plain parameters and param groups route as DeepSpeed's engine routes them (it tags every
parameter of the model with ``use_muon`` from its name and shape): matrices to Muon,
embeddings, ``lm_head`` and 1-D parameters to the auxiliary Adam. The flag lives in Muon's own
name mapping and groups, never on the parameters. A group's ``use_muon`` key sets its half
for all of its parameters, the way to route a single parameter by hand. (DeepSpeed's engine
drops a group's ``use_muon`` and re-tags every model parameter by the rule; only parameters
outside the model keep a flag the caller set on them, which here is the group's flag.)

``bf16.bf16_optimizer_states`` asks for 16-bit optimizer states. A config-built optimizer that
keeps its moments in fp32 by default (DeepShard's Adam family, Lion, Muon) is then built with
``fp32_optimizer_states: false``, overriding (with a warning) a ``true`` in its params, as
DeepSpeed overrides its CPU Adam; a caller's optimizer that says ``fp32_optimizer_states=True``
is refused, since its fp32 moments are not what the config asks for.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any, TypeAlias

import torch

from deepshard.interface.config import DeepShardConfig, OptimizerConfig
from deepshard.interface.errors import ConfigError
from deepshard.optimizers import build_optimizer
from deepshard.optimizers.build import takes_param
from deepshard.optimizers.schedules import build_scheduler

__all__ = [
    "OptimizerArg",
    "SchedulerArg",
    "default_parameters",
    "select_optimizer",
    "select_scheduler",
]

_log = logging.getLogger("deepshard.engine")

OptimizerArg: TypeAlias = torch.optim.Optimizer | Callable[[Any], torch.optim.Optimizer] | None
"""An optimizer, a callable building one from the parameters, or None (use the config)."""

SchedulerArg: TypeAlias = Any
"""A schedule (anything with ``step()``, e.g. an `LRSchedule` or a torch scheduler), a callable
building one from the wrapped optimizer, or None (use the config)."""


def select_optimizer(
    optimizer: OptimizerArg,
    params: Iterable[Any],
    config: DeepShardConfig,
    *,
    module: torch.nn.Module | None = None,
) -> torch.optim.Optimizer | None:
    """The optimizer ZeRO will wrap.

    Args:
        optimizer: The caller's optimizer, a callable building one, or None.
        params: ``model_parameters`` (parameters or param groups), or the module's parameters.
        config: The whole config; its ``optimizer`` section is built when ``optimizer`` is None.
        module: The model; its parameter names route a config-built Muon's parameters.

    Returns:
        The optimizer; None when neither the caller nor the config gives one (the engine then
        runs forward passes only).

    Raises:
        ConfigError: A bad ``optimizer`` section, or a callable that returned no optimizer.
    """
    if optimizer is not None and config.optimizer is not None:
        _log.warning("initialize got an optimizer; the config's optimizer section is ignored")
    if isinstance(optimizer, torch.optim.Optimizer):
        return _states_as_asked(optimizer, config)
    if optimizer is not None:
        built = optimizer(params)
        if not isinstance(built, torch.optim.Optimizer):
            raise ConfigError(
                f"the optimizer callable passed to initialize returned {type(built).__name__}, "
                "not a torch.optim.Optimizer"
            )
        return _states_as_asked(built, config)
    if config.optimizer is None:
        return None
    names = dict(module.named_parameters()) if module is not None else None
    section = config.optimizer
    if config.bf16.bf16_optimizer_states:
        section = _with_16bit_states(section)
    return build_optimizer(section, params, names=names)


def _with_16bit_states(section: OptimizerConfig) -> OptimizerConfig:
    """The ``optimizer`` section with ``fp32_optimizer_states: false`` for the types that take
    it (the others keep their moments in the parameters' dtype anyway)."""
    if not takes_param(section.type, "fp32_optimizer_states"):
        return section
    if section.params.get("fp32_optimizer_states") is True:
        _log.warning(
            "bf16.bf16_optimizer_states is set: optimizer.params.fp32_optimizer_states true is "
            "overridden to false, so the moments are kept in bf16"
        )
    params = {**section.params, "fp32_optimizer_states": False}
    return section.model_copy(update={"params": params})


def _states_as_asked(
    optimizer: torch.optim.Optimizer, config: DeepShardConfig
) -> torch.optim.Optimizer:
    """The caller's optimizer, unless it keeps fp32 moments while the config asks for bf16 ones.

    Raises:
        ConfigError: ``bf16.bf16_optimizer_states`` with ``fp32_optimizer_states=True``.
    """
    if config.bf16.bf16_optimizer_states and getattr(optimizer, "fp32_optimizer_states", False):
        raise ConfigError.from_problems(
            [("bf16.bf16_optimizer_states", f"asks for bf16 optimizer states, but the "
              f"{type(optimizer).__name__} passed to initialize keeps fp32 moments "
              "(fp32_optimizer_states=True); build it with fp32_optimizer_states=False")]
        )  # fmt: skip
    return optimizer


def default_parameters(module: torch.nn.Module, config: DeepShardConfig) -> Iterable[Any]:
    """What the optimizer trains when the caller names nothing: the module's parameters, with
    their names for Muon (it sends embeddings and output heads to its auxiliary Adam by name)."""
    if config.optimizer is not None and config.optimizer.type.lower() == "muon":
        return list(module.named_parameters())
    return module.parameters()


def select_scheduler(
    lr_scheduler: SchedulerArg,
    optimizer: torch.optim.Optimizer | None,
    config: DeepShardConfig,
) -> Any:
    """The LR schedule the engine steps once per applied optimizer step.

    Args:
        lr_scheduler: The caller's schedule, a callable building one from ``optimizer``, or
            None.
        optimizer: The ZeRO-wrapped optimizer (its ``param_groups`` are the inner optimizer's).
        config: The whole config; its ``scheduler`` section is built when ``lr_scheduler`` is
            None.

    Returns:
        The schedule, or None.

    Raises:
        ConfigError: A bad ``scheduler`` section, a schedule without an optimizer, or a
            schedule object without ``step()``.
    """
    if lr_scheduler is not None and config.scheduler is not None:
        _log.warning("initialize got an lr_scheduler; the config's scheduler section is ignored")
    if lr_scheduler is None and config.scheduler is None:
        return None
    if optimizer is None:
        raise ConfigError.from_problems(
            [("scheduler", "an LR schedule needs an optimizer; add an optimizer section")]
        )
    if lr_scheduler is None:
        assert config.scheduler is not None
        return build_scheduler(config.scheduler, optimizer)
    schedule = lr_scheduler
    # A class is a factory too (it has a `step` attribute, unbound); an instance is the schedule.
    if isinstance(lr_scheduler, type) or (
        not hasattr(lr_scheduler, "step") and callable(lr_scheduler)
    ):
        schedule = lr_scheduler(optimizer)
    if not callable(getattr(schedule, "step", None)):
        raise ConfigError(
            f"the lr_scheduler passed to initialize ({type(schedule).__name__}) has no step() "
            "method; pass a schedule or a callable that builds one from the optimizer"
        )
    return schedule
