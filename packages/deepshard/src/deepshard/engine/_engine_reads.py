"""What a training loop reads from the engine: counters, learning rates, batch sizes, settings.

DeepSpeed scripts ask their engine ``engine.fp16_enabled()``, ``engine.get_lr()`` or
``engine.global_steps``; these readers answer from the parts ``initialize`` built and change
nothing. They live in this mixin so the engine class itself holds only the training loop.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from deepshard.engine._reporting import TensorBytes, tensor_bytes
from deepshard.interface.errors import ConfigError

if TYPE_CHECKING:
    from deepshard.engine._engine import EngineParts
    from deepshard.engine.loss_scaler import LossScaler
    from deepshard.zero import ZeroOptimizer

__all__ = ["EngineReads"]


def _counter(name: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"engine.{name} must be set to an int >= 0, got {value!r}")
    return value


class EngineReads:
    """Read-only accessors of `DeepShardEngine` (a mixin: the engine sets the attributes)."""

    module: torch.nn.Module
    parts: EngineParts
    optimizer: ZeroOptimizer | None
    loss_scaler: LossScaler
    _grad_norm: float | None

    @property
    def global_steps(self) -> int:
        """Optimizer steps so far (applied or skipped for overflow). Settable, as in DeepSpeed
        (Megatron-DeepSpeed sets it to the iteration it resumes from)."""
        return self.parts.accumulation.global_steps

    @global_steps.setter
    def global_steps(self, value: int) -> None:
        self.parts.accumulation.global_steps = _counter("global_steps", value)

    @property
    def global_samples(self) -> int:
        """Samples consumed by those steps over all data-parallel ranks (settable)."""
        return self.parts.accumulation.global_samples

    @global_samples.setter
    def global_samples(self, value: int) -> None:
        self.parts.accumulation.global_samples = _counter("global_samples", value)

    @property
    def micro_steps(self) -> int:
        """``step()`` calls so far."""
        return self.parts.accumulation.micro_steps

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps skipped because a gradient overflowed."""
        return self.parts.accumulation.skipped_steps

    def get_lr(self) -> list[float]:
        """The learning rate of each param group (empty without an optimizer)."""
        return [float(group["lr"]) for group in self._groups()]

    def get_mom(self) -> list[Any]:
        """Each param group's momentum: its ``betas`` (Adam-like), else its ``momentum`` (SGD,
        RMSprop, Muon), else 0.0, as DeepSpeed reports it (empty without an optimizer)."""
        return [group.get("betas", group.get("momentum", 0.0)) for group in self._groups()]

    def _groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups if self.optimizer is not None else []

    def get_global_grad_norm(self) -> float | None:
        """The global norm of the last step's unscaled gradients, before clipping."""
        return self._grad_norm

    @property
    def loss_scale(self) -> float:
        """The current loss scale (1 unless training in float16)."""
        return self.loss_scaler.scale

    def train_batch_size(self) -> int:
        """Samples per optimizer step over all data-parallel ranks."""
        return self.parts.batch.train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int:
        """Samples per forward/backward pass on one rank."""
        return self.parts.batch.train_micro_batch_size_per_gpu

    def gradient_accumulation_steps(self) -> int:
        """Micro-batches accumulated per optimizer step."""
        return self.parts.batch.gradient_accumulation_steps

    def zero_optimization_stage(self) -> int:
        """The ZeRO stage the engine runs (``zero_optimization.stage``)."""
        return self.parts.config.zero_optimization.stage

    def fp16_enabled(self) -> bool:
        """Whether the model trains in float16 (``fp16.enabled``)."""
        return self.parts.config.fp16.enabled

    def bfloat16_enabled(self) -> bool:
        """Whether the model trains in bfloat16 (``bf16.enabled``)."""
        return self.parts.config.bf16.enabled

    def gradient_clipping(self) -> float:
        """The global gradient-norm limit (``gradient_clipping``; 0 means no clipping)."""
        return float(self.parts.config.gradient_clipping)

    def memory_bytes(self) -> TensorBytes:
        """This rank's parameter, gradient, master-weight and optimizer-state bytes."""
        return tensor_bytes(self.module, self.optimizer)
