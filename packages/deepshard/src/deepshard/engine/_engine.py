"""`DeepShardEngine`: the model, wrapped so one loop trains it at any ZeRO stage and precision.

The engine builds nothing and decides nothing itself (``initialize`` builds the parts); each call
runs the parts in order:

* ``engine(*args)`` runs the module's forward under the precision's autocast and input cast.
* ``engine.backward(loss)`` divides the loss by the accumulation steps, multiplies it by the
  loss scale, and runs backward through ZeRO, whose parameter hooks reduce the gradients at the
  accumulation boundary.
* ``engine.step()``, called after every micro-batch, counts the micro-step; at the boundary it
  lets ZeRO unscale, check, clip and apply the gradients, tells the loss scaler whether the
  step overflowed, and advances the LR schedule only for an applied step.

Gradient reduction is driven by hooks, so a plain ``loss.backward()`` works too: the caller
then does the engine's two multiplications itself, ``engine.scale(loss /
engine.gradient_accumulation_steps()).backward()``. Without ``scale`` an fp16 run's gradients
would be divided by a loss scale they were never multiplied by (fp32 and bf16 runs have scale 1,
so only the division by the accumulation steps matters there).

Checkpoints are the checkpoint package's: it reads ``optimizer.shard_maps()`` and
``optimizer.state_dict()`` (ZeRO), ``lr_scheduler.state_dict()``, ``loss_scaler.state_dict()``
and ``accumulation.state_dict()`` (the step counters) from the engine's parts.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh

from deepshard.comm import CommsLogger
from deepshard.engine._accumulation import GradientAccumulation
from deepshard.engine._precision import Precision
from deepshard.engine._profiling import StepProfiling
from deepshard.engine._reporting import ProgressReporter, TensorBytes, tensor_bytes
from deepshard.engine.loss_scaler import LossScaler
from deepshard.interface import BatchSizes, DeepShardConfig
from deepshard.interface.errors import ConfigError
from deepshard.zero import ZeroOptimizer

__all__ = ["DeepShardEngine", "EngineParts"]


@dataclass(frozen=True)
class EngineParts:
    """What `initialize` built for the engine.

    Attributes:
        config: The validated config.
        batch: The reconciled batch sizes.
        mesh: The training mesh.
        device: Where the model lives.
        precision: Model dtype, autocast and loss-scaling plan.
        optimizer: The ZeRO-wrapped optimizer; None for a forward-only engine.
        lr_scheduler: The LR schedule, or None.
        loss_scaler: The loss scaler.
        accumulation: The micro-step and step counters.
        reporter: Progress lines and timers.
        comms_logger: The communication logger passed to ZeRO, or None.
        profiling: The ``flops_profiler`` step profile.
    """

    config: DeepShardConfig
    batch: BatchSizes
    mesh: DeviceMesh
    device: torch.device
    precision: Precision
    optimizer: ZeroOptimizer | None
    lr_scheduler: Any
    loss_scaler: LossScaler
    accumulation: GradientAccumulation
    reporter: ProgressReporter
    comms_logger: CommsLogger | None
    profiling: StepProfiling


class DeepShardEngine(torch.nn.Module):
    """The training engine `deepshard.engine.initialize` returns.

    Args:
        module: The model (already cast and on its device).
        parts: The components `initialize` built.
    """

    def __init__(self, module: torch.nn.Module, parts: EngineParts) -> None:
        super().__init__()
        self.module = module
        self.parts = parts
        self.optimizer = parts.optimizer
        self.lr_scheduler = parts.lr_scheduler
        self.loss_scaler = parts.loss_scaler
        self.accumulation = parts.accumulation
        self.comms_logger = parts.comms_logger
        self.mesh = parts.mesh
        self.device = parts.device
        self._timers = parts.reporter.timers
        self._step_applied = False
        self._grad_norm: float | None = None
        self._declare_boundary()

    # --- the training loop ----------------------------------------------------------------

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the module's forward (under autocast / with fp16 inputs when configured)."""
        precision = self.parts.precision
        self.parts.profiling.before_forward(self.global_steps)
        with self._timers.time("forward"), precision.forward_context(self.device.type):
            args, kwargs = precision.inputs(args, kwargs)
            return self.module(*args, **kwargs)

    def backward(
        self, loss: torch.Tensor, *, retain_graph: bool = False, scale_wrt_gas: bool = True
    ) -> torch.Tensor:
        """Backpropagate one micro-batch's loss, scaled for accumulation and fp16.

        Args:
            loss: The micro-batch's loss (a scalar with a graph).
            retain_graph: Keep the graph for another backward pass.
            scale_wrt_gas: Divide by ``gradient_accumulation_steps`` (so the accumulated
                gradient is the mean over micro-batches).

        Returns:
            The loss divided by the accumulation steps (not multiplied by the loss scale).

        Raises:
            ConfigError: The engine has no optimizer.
        """
        zero = self._require_optimizer("backward")
        self.parts.reporter.add_loss(loss)
        accumulated = loss / self.gradient_accumulation_steps() if scale_wrt_gas else loss
        with self._timers.time("backward"):
            zero.backward(
                self.scale(accumulated),
                is_boundary=self.is_gradient_accumulation_boundary(),
                retain_graph=retain_graph,
            )
        return accumulated

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` times the current loss scale (itself when the scale is 1).

        For a plain ``loss.backward()``: ``engine.scale(loss / accumulation_steps).backward()``.
        """
        scale = self.loss_scaler.scale
        return loss if scale == 1.0 else loss.float() * scale

    def step(self) -> None:
        """End one micro-step; at the accumulation boundary, apply (or skip) the update.

        Raises:
            ConfigError: The engine has no optimizer, or gradients overflow at
                ``fp16.min_loss_scale``.
            CommError: No boundary backward pass preceded the boundary's step.
        """
        zero = self._require_optimizer("step")
        boundary = self.is_gradient_accumulation_boundary()
        self._step_applied = False
        loss_scale = self.loss_scaler.scale
        if boundary:
            with self._timers.time("step"):
                result = zero.step(loss_scale=loss_scale)
                self.loss_scaler.update(result.overflow)
                self._step_applied = not result.overflow
                self._grad_norm = result.grad_norm
                if self._step_applied and self.lr_scheduler is not None:
                    self.lr_scheduler.step()
        self.accumulation.advance(applied=self._step_applied)
        self._declare_boundary()
        if boundary:
            self.parts.profiling.after_step(self.global_steps - 1, self._timers.end_step())
            self.parts.reporter.end_step(
                step=self.global_steps,
                lrs=self.get_lr(),
                grad_norm=self._grad_norm,
                loss_scale=loss_scale,
            )

    def _declare_boundary(self) -> None:
        """Tell ZeRO whether the coming backward pass ends the accumulation cycle (so a plain
        ``loss.backward()`` reduces exactly at the boundary)."""
        if self.optimizer is not None:
            self.optimizer.set_boundary(self.is_gradient_accumulation_boundary())

    def _require_optimizer(self, what: str) -> ZeroOptimizer:
        if self.optimizer is None:
            raise ConfigError.from_problems(
                [
                    (
                        "optimizer",
                        f"engine.{what}() needs an optimizer: add an optimizer section to the "
                        "config or pass optimizer= to initialize",
                    )
                ]
            )
        return self.optimizer

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside only accumulate gradients (no boundary, no update)."""
        zero = self._require_optimizer("no_sync")
        with zero.no_sync():
            yield

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the gradients accumulated since the last step (ZeRO always frees them)."""
        self._require_optimizer("zero_grad").zero_grad(set_to_none)

    # --- what the loop reads --------------------------------------------------------------

    def is_gradient_accumulation_boundary(self) -> bool:
        """Whether the current micro-step's ``step()`` will apply an update."""
        return self.accumulation.is_boundary()

    def was_step_applied(self) -> bool:
        """Whether the last ``step()`` applied an update (False off-boundary or on overflow)."""
        return self._step_applied

    @property
    def global_steps(self) -> int:
        """Optimizer steps so far (applied or skipped for overflow)."""
        return self.accumulation.global_steps

    @property
    def global_samples(self) -> int:
        """Samples consumed by those steps over all data-parallel ranks."""
        return self.accumulation.global_samples

    @property
    def micro_steps(self) -> int:
        """``step()`` calls so far."""
        return self.accumulation.micro_steps

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps skipped because a gradient overflowed."""
        return self.accumulation.skipped_steps

    def get_lr(self) -> list[float]:
        """The learning rate of each param group (empty without an optimizer)."""
        groups = self.optimizer.param_groups if self.optimizer is not None else []
        return [float(group["lr"]) for group in groups]

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

    def memory_bytes(self) -> TensorBytes:
        """This rank's parameter, gradient, master-weight and optimizer-state bytes."""
        return tensor_bytes(self.module, self.optimizer)
