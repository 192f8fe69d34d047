"""The engine's training features beyond the loop: activation checkpointing, curriculum,
dynamic batching, random-LTD.

A mixin of `DeepShardEngine`, so the engine class keeps only the loop: each feature is built
from its config section on first use and the loop calls one method per feature.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import Dataset

from deepshard.engine._token_budget_loader import TokenBudgetLoader, dynamic_batching_loader
from deepshard.engine.checkpointing import Checkpointer
from deepshard.engine.curriculum import (
    CurriculumScheduler,
    curriculum_schedulers,
    truncate_to_seqlen,
)
from deepshard.engine.dynamic_batching import scale_lr
from deepshard.engine.random_ltd import (
    RandomLtdScheduler,
    attach_random_ltd,
    draw_seed,
    find_layers,
)
from deepshard.interface.config import RandomLtdConfig
from deepshard.interface.errors import ConfigError

if TYPE_CHECKING:
    from deepshard.comm import ParallelDims
    from deepshard.engine._engine import EngineParts
    from deepshard.zero import ZeroOptimizer

__all__ = ["EngineFeatures"]

_LOG = logging.getLogger("deepshard.engine")


class EngineFeatures:
    """Activation checkpointing, curriculum learning, dynamic batching and random-LTD of
    `DeepShardEngine` (a mixin)."""

    module: torch.nn.Module
    parts: EngineParts
    parallel_dims: ParallelDims
    device: torch.device
    optimizer: ZeroOptimizer | None
    training_dataloader: Any

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

    # --- dynamic batching -----------------------------------------------------------------

    def dynamic_batching_loader(
        self,
        dataset: Dataset[Any],
        *,
        seqlens: Sequence[int] | None = None,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        filter_ids: Sequence[int] | None = None,
    ) -> TokenBudgetLoader:
        """This rank's loader of token-budget micro-batches (``dynamic_batching`` config).

        DeepSpeed's ``get_dataloader_and_lr_scheduler_for_variable_batch_size_deepspeed``:
        samples are packed into groups of at most ``max_tokens`` tokens, a step consumes
        ``train_batch_size`` groups (see `deepshard.engine.dynamic_batching`), and from then
        on the engine scales each optimizer step's learning rate by the samples in the step it
        served (``lr_scaling_method``); there is no second scheduler to step. The loader
        becomes ``engine.training_dataloader``, so checkpoints store its position.
        ``initialize(training_data=...)`` calls this when dynamic batching is on.

        Args:
            dataset: A map-style dataset.
            seqlens: Each sample's length; else the ``metrics_path`` metric, else each
                sample's length (a 1-D tensor, a list, or a dict's ``input_ids``).
            collate_fn: Turns a micro-batch's list of samples into a batch.
            filter_ids: The samples to use (all when None).

        Raises:
            ConfigError: Dynamic batching is off, the lengths cannot be had, or they do not
                give one step.
        """
        dims = self.parallel_dims
        loader = dynamic_batching_loader(
            dataset, self.parts.config.data_efficiency, self.parts.batch,
            rank=dims.batch_rank, ranks=dims.batch_world_size, seqlens=seqlens,
            collate_fn=collate_fn, filter_ids=filter_ids,
        )  # fmt: skip
        self.training_dataloader = loader
        return loader

    @contextlib.contextmanager
    def _batch_scaled_lr(self) -> Iterator[None]:
        """Within: the param groups' rates scaled for the served step's sample count (dynamic
        batching); the schedule's values are put back on exit."""
        loader = self.training_dataloader
        samples = (
            loader.batch_sampler.samples_in_served_step()
            if isinstance(loader, TokenBudgetLoader)
            else None
        )
        if samples is None or self.optimizer is None:
            yield
            return
        section = self.parts.config.data_efficiency.data_sampling.dynamic_batching
        reference = self.parts.batch.train_batch_size
        groups = self.optimizer.param_groups
        unscaled = [group["lr"] for group in groups]
        for group, lr in zip(groups, unscaled, strict=True):
            group["lr"] = scale_lr(lr, samples, reference, section.lr_scaling_method)
        if section.verbose and self.parallel_dims.rank == 0:
            _LOG.info(
                "dynamic batching: step of %d samples (reference %d): lr %s -> %s",
                samples, reference, unscaled, [group["lr"] for group in groups],
            )  # fmt: skip
        try:
            yield
        finally:
            for group, lr in zip(groups, unscaled, strict=True):
                group["lr"] = lr

    # --- random-LTD -----------------------------------------------------------------------

    def random_ltd_enabled(self) -> bool:
        """Whether ``data_efficiency.data_routing.random_ltd`` is enabled."""
        return self.random_ltd_config().enabled

    def random_ltd_config(self) -> RandomLtdConfig:
        """The ``random_ltd`` config section."""
        return self.parts.config.data_efficiency.data_routing.random_ltd

    @property
    def random_ltd_scheduler(self) -> RandomLtdScheduler | None:
        """The kept-token schedule (None when random-LTD is off)."""
        if not self.random_ltd_enabled():
            return None
        built = self.__dict__.get("_random_ltd_scheduler")
        if built is None:
            section = self.random_ltd_config()
            batch = section.global_batch_size or self.parts.batch.train_batch_size
            built = RandomLtdScheduler(section, batch)
            self.__dict__["_random_ltd_scheduler"] = built
        return built

    def random_ltd_initialize(self, layer_type: type | None = None) -> None:
        """Make the configured layers drop tokens (`deepshard.engine.random_ltd`).

        ``initialize`` calls it when random-LTD is on; call it again with the layer class
        when the model's layers cannot be found on their own (DeepSpeed's
        ``convert_to_random_ltd(engine, LayerClass)`` does the same).

        Args:
            layer_type: The transformer layer class; None finds the model's layer list.

        Raises:
            ConfigError: Random-LTD is off, or the layers or ids do not fit the config.
        """
        section = self.random_ltd_config()
        if not section.enabled:
            raise ConfigError.from_problems(
                [(section.config_key + ".enabled", "random-LTD is off; set it to true")]
            )
        self._hook_random_ltd(find_layers(self.module, layer_type))

    def _hook_random_ltd(self, layers: list[torch.nn.Module]) -> None:
        for handle in self.__dict__.pop("_random_ltd_hooks", []):
            handle.remove()
        scheduler = self.random_ltd_scheduler
        dims, accumulation = self.parallel_dims, self.parts.accumulation
        seed = self.parts.config.data_efficiency.seed
        self.__dict__["_random_ltd_hooks"] = attach_random_ltd(
            layers,
            self.random_ltd_config(),
            draw_seed=lambda: draw_seed(seed, accumulation.micro_steps, dims.batch_rank),
            kept=lambda: scheduler.get_current_seq() if scheduler is not None else None,
        )

    def _random_ltd_at_initialize(self) -> None:
        """Hook the layers when random-LTD is on and the model's layer list is clear; else
        leave it to `random_ltd_initialize` with the layer class (checked at the forward)."""
        if not self.random_ltd_enabled():
            return
        try:
            layers = find_layers(self.module)
        except ConfigError as exc:
            _LOG.info("%s (random-LTD waits for convert_to_random_ltd)", exc)
            return
        self._hook_random_ltd(layers)

    def _random_ltd_update(self) -> None:
        """Before a training forward: move the schedule to the current global step."""
        scheduler = self.random_ltd_scheduler
        if scheduler is None or not self.module.training:
            return
        if "_random_ltd_hooks" not in self.__dict__:
            raise ConfigError(
                "random-LTD is on but no layer drops tokens: the model's layers were not found "
                "at initialize; call deepshard.engine.random_ltd.convert_to_random_ltd(engine, "
                "LayerClass) before training"
            )
        scheduler.update_seq(self.parts.accumulation.global_steps)
