"""The engine's training features beyond the loop: activation checkpointing, curriculum.

A mixin of `DeepShardEngine`, so the engine class keeps only the loop: each feature is built
from its config section on first use and the loop calls one method per feature.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from deepshard.engine.checkpointing import Checkpointer

if TYPE_CHECKING:
    from deepshard.comm import ParallelDims
    from deepshard.engine._engine import EngineParts

__all__ = ["EngineFeatures"]


class EngineFeatures:
    """Activation checkpointing and curriculum learning of `DeepShardEngine` (a mixin)."""

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
