"""The engine's training features beyond the loop: activation checkpointing, curriculum.

A mixin of `DeepShardEngine`, so the engine class keeps only the loop: each feature is built
from its config section on first use and the loop calls one method per feature.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch

from deepshard.engine.checkpointing import Checkpointer
from deepshard.engine.curriculum import (
    CurriculumScheduler,
    curriculum_schedulers,
    truncate_to_seqlen,
)
from deepshard.interface.errors import ConfigError

if TYPE_CHECKING:
    from deepshard.comm import ParallelDims
    from deepshard.engine._engine import EngineParts

__all__ = ["EngineFeatures"]


class EngineFeatures:
    """Activation checkpointing and curriculum learning of `DeepShardEngine` (a mixin)."""

    module: torch.nn.Module
    parts: EngineParts
    parallel_dims: ParallelDims
    device: torch.device

    @property
    def checkpointing(self) -> Checkpointer:
        """Activation checkpointing with the config's ``activation_checkpointing`` settings,
        partitioning over the mesh's tp group: ``engine.checkpointing.checkpoint(block, x)``
        or ``engine.checkpointing.wrap(block)``; set its ``rng_tracker`` for tp dropout.

        Built on first use, so a config whose ``contiguous_memory_optimization`` lacks
        ``number_checkpoints`` fails only when checkpointing is used (as in DeepSpeed).

        Raises:
            ConfigError: ``contiguous_memory_optimization`` without ``number_checkpoints``.
        """
        built = self.__dict__.get("_checkpointer")
        if built is None:
            built = Checkpointer(
                self.parts.config.activation_checkpointing,
                tp=self.parallel_dims.tp,
                device=self.device,
            )
            self.__dict__["_checkpointer"] = built
        return built

    # --- curriculum learning --------------------------------------------------------------

    @property
    def _curricula(self) -> dict[str, CurriculumScheduler]:
        built = self.__dict__.get("_curriculum_schedulers")
        if built is None:
            built = curriculum_schedulers(self.parts.config)
            self.__dict__["_curriculum_schedulers"] = built
        return built

    def curriculum_enabled_legacy(self) -> bool:
        """Whether the legacy ``curriculum_learning`` section is enabled."""
        return self.parts.config.curriculum_learning.enabled

    def curriculum_learning_enabled(self) -> bool:
        """Whether ``data_efficiency``'s curriculum (with its sampling section) is enabled."""
        return bool(self._curricula) and not self.curriculum_enabled_legacy()

    def set_custom_curriculum_learning_schedule(
        self, schedule: Callable[[int], int] | Mapping[str, Callable[[int], int]]
    ) -> None:
        """Set the function of every ``custom`` schedule (or, from a dict, by metric name).

        Args:
            schedule: ``difficulty = fn(global_step)``, or DeepSpeed's dict of metric name to
                such a function (``"curriculum_learning"`` names the legacy schedule).

        Raises:
            ConfigError: No enabled schedule is ``custom``, or the dict names another metric.
        """
        custom = {n: s for n, s in self._curricula.items() if s.section.schedule_type == "custom"}
        functions = schedule if isinstance(schedule, Mapping) else dict.fromkeys(custom, schedule)
        unknown = sorted(set(functions) - set(custom))
        if not custom or unknown:
            raise ConfigError(
                f"set_custom_curriculum_learning_schedule: custom schedules are {sorted(custom)}"
                f"{f', not {unknown}' if unknown else ''}; set schedule_type 'custom' in the "
                "curriculum config for the metrics it should drive"
            )
        for name, function in functions.items():
            custom[name].custom = function

    def curriculum_difficulty(self, metric: str | None = None) -> int:
        """A schedule's current difficulty (the only one when ``metric`` is None).

        Raises:
            ConfigError: No curriculum is enabled, or ``metric`` is not one of its schedules.
        """
        curricula = self._curricula
        if metric is None and len(curricula) == 1:
            return next(iter(curricula.values())).difficulty
        if metric not in curricula:
            raise ConfigError(
                f"curriculum_difficulty({metric!r}): the enabled schedules are "
                f"{sorted(curricula)}; enable curriculum_learning or name one of them"
            )
        return curricula[metric].difficulty

    def curriculum_state_dict(self) -> dict[str, Any]:
        """Every schedule's state by name (JSON data, for the checkpoint)."""
        return {name: s.state_dict() for name, s in self._curricula.items()}

    def load_curriculum_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore `curriculum_state_dict`'s states.

        Raises:
            ConfigError: ``state`` names other schedules than the config enables.
        """
        curricula = self._curricula
        if set(state) != set(curricula):
            raise ConfigError(
                f"curriculum state has schedules {sorted(state)} but the config enables "
                f"{sorted(curricula)}; load it with the config it was saved with"
            )
        for name, scheduler in curricula.items():
            scheduler.load_state_dict(state[name])

    def _curriculum_inputs(
        self, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """Step the schedules to the coming global step and cut the batch to its seqlen."""
        curricula = self._curricula
        if not curricula or not self.module.training:
            return args, kwargs
        step = self.parts.accumulation.global_steps + 1
        lengths = [s.update(step) for s in curricula.values() if s.is_seqlen]
        for scheduler in curricula.values():
            if not scheduler.is_seqlen:
                scheduler.update(step)
        return truncate_to_seqlen(args, kwargs, min(lengths)) if lengths else (args, kwargs)
