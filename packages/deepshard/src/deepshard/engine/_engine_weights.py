"""The engine's weights out: ``module_state_dict`` and ``save_16bit_model`` (a mixin).

Both hand over to `deepshard.engine._export`, with the model side of ZeRO stage 3 (whose
parameters must be gathered) or nothing.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from deepshard.engine import _export
from deepshard.interface.errors import ConfigError
from deepshard.zero import ShardedModule, Stage3Optimizer

if TYPE_CHECKING:
    from deepshard.comm import ParallelDims
    from deepshard.zero import ZeroOptimizer

__all__ = ["EngineWeights"]


class EngineWeights:
    """`DeepShardEngine`'s weight export (a mixin)."""

    module: torch.nn.Module
    optimizer: ZeroOptimizer | None
    parallel_dims: ParallelDims

    def module_state_dict(self, exclude_frozen_parameters: bool = False) -> dict[str, Any]:
        """The module's ``state_dict()`` without frozen parameters when asked: live tensors at
        stages 0-2; at stage 3 gathered copies (every rank must call it)."""
        return _export.module_state_dict(
            self.module, exclude_frozen_parameters=exclude_frozen_parameters, sharded=self._sharded
        )

    def _zero3_consolidated_16bit_state_dict(
        self, exclude_frozen_parameters: bool = False
    ) -> dict[str, Any] | None:
        """DeepSpeed's name, which OpenRLHF-style and accelerate-style code calls at stage 3:
        the gathered state dict on rank 0 and None elsewhere (every rank must call it).

        Raises:
            ConfigError: The engine is not at ZeRO stage 3 (use `module_state_dict`).
        """
        if self._sharded is None:
            raise ConfigError(
                "_zero3_consolidated_16bit_state_dict needs ZeRO stage 3 (the parameters are "
                "whole on every rank below it); use engine.module_state_dict()"
            )
        state = self.module_state_dict(exclude_frozen_parameters)
        return state if self.parallel_dims.world.get_rank() == 0 else None

    def save_16bit_model(
        self,
        save_dir: str | Path,
        save_filename: str = "pytorch_model.bin",
        exclude_frozen_parameters: bool = False,
    ) -> Path:
        """Write the model's weights to one safetensors file (at stage 3 every rank must call
        it; at stages 0-2 rank 0 alone may, as with DeepSpeed).

        Rank 0 writes the module's state dict in its training dtype (16-bit under bf16/fp16);
        DeepShard never pickles, so DeepSpeed's default name ``pytorch_model.bin`` becomes
        ``model.safetensors`` (Hugging Face's name) and another ``.bin``/``.pt``/``.pth``/
        ``.ckpt`` name gets the ``.safetensors`` suffix.

        Args:
            save_dir: The directory (created when missing).
            save_filename: The file name, as in DeepSpeed.
            exclude_frozen_parameters: Leave out parameters with ``requires_grad=False``.

        Returns:
            The written file's path (truthy, where DeepSpeed returns True).

        Raises:
            ConfigError: ``save_filename`` has another suffix.
        """
        return _export.save_16bit_model(
            self.module,
            save_dir,
            save_filename,
            world=self.parallel_dims.world,
            exclude_frozen_parameters=exclude_frozen_parameters,
            sharded=self._sharded,
        )

    @property
    def _sharded(self) -> ShardedModule | None:
        """The model side at ZeRO stage 3 (parameters partitioned), else None."""
        return self.optimizer.sharded if isinstance(self.optimizer, Stage3Optimizer) else None
