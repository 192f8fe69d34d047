"""`DeepShardEngine`: the model, wrapped so one loop trains it at any ZeRO stage and precision.

The engine builds nothing and decides nothing itself (``initialize`` builds the parts); each call
runs the parts in order:

* ``engine(*args)`` runs the module's forward under the precision's autocast and input cast,
  and under `deepshard.zero.offload_saved_tensors` when ``activation_checkpointing.
  cpu_checkpointing`` is set (the activations autograd saves wait for backward on the host).
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

A DeepSpeed script may also use ``engine.no_sync()`` (not nested) or
``engine.set_gradient_accumulation_boundary(flag)`` to choose the boundary itself, and
``engine.save_16bit_model(save_dir)`` (safetensors, `deepshard.engine._export`),
``engine.offload_states()`` / ``reload_states()`` and the ``safe_get_*`` / ``safe_set_*``
accessors (`deepshard.engine._engine_states`); ``engine.checkpointing`` checkpoints blocks
with the ``activation_checkpointing`` settings (`deepshard.engine._engine_features`). A DeepSpeed
engine name DeepShard leaves out raises an ``AttributeError`` saying what to use instead
(`deepshard.engine._unsupported`).

``with engine.generation_context(gather_units=k) as view:`` generates from the training weights
between steps (`deepshard.engine._generation`; `deepshard.inference`'s rollouts enter it).

``engine.save_checkpoint`` / ``load_checkpoint`` (`deepshard.engine._checkpointing`) store
ZeRO's `state_shards` and the parts' JSON state through the checkpoint package.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from deepshard.comm import CommsLogger, DistInfo, ParallelDims
from deepshard.engine._accumulation import GradientAccumulation
from deepshard.engine._checkpointing import EngineCheckpointing
from deepshard.engine._compile import EngineCompile
from deepshard.engine._engine_features import EngineFeatures
from deepshard.engine._engine_reads import EngineReads
from deepshard.engine._engine_states import EngineStates
from deepshard.engine._engine_weights import EngineWeights
from deepshard.engine._generation import GenerationView, generation_context
from deepshard.engine._plain_backward import PlainBackward
from deepshard.engine._precision import Precision
from deepshard.engine._profiling import StepProfiling
from deepshard.engine._reporting import ProgressReporter
from deepshard.engine._tensor_parallel import TpInputCheck
from deepshard.engine._unsupported import refused_attribute_message
from deepshard.engine.loss_scaler import LossScaler
from deepshard.interface import BatchSizes, DeepShardConfig
from deepshard.interface.errors import CommError, ConfigError
from deepshard.zero import ZeroOptimizer, offload_saved_tensors

__all__ = ["DeepShardEngine", "EngineParts"]


@dataclass(frozen=True)
class EngineParts:
    """What `initialize` built for the engine.

    Attributes:
        config: The validated config.
        batch: The reconciled batch sizes.
        dims: The training mesh and its derived groups.
        device: Where the model lives.
        precision: Model dtype, autocast and loss-scaling plan.
        optimizer: The ZeRO-wrapped optimizer; None for a forward-only engine.
        lr_scheduler: The LR schedule, or None.
        loss_scaler: The loss scaler.
        accumulation: The micro-step and step counters.
        reporter: Progress lines and timers.
        comms_logger: The communication logger passed to ZeRO, or None.
        world: Where this process sits in the world (global and local rank, world size).
        profiling: The ``flops_profiler`` step profile.
    """

    config: DeepShardConfig
    batch: BatchSizes
    dims: ParallelDims
    device: torch.device
    precision: Precision
    optimizer: ZeroOptimizer | None
    lr_scheduler: Any
    loss_scaler: LossScaler
    accumulation: GradientAccumulation
    reporter: ProgressReporter
    comms_logger: CommsLogger | None
    world: DistInfo
    profiling: StepProfiling


def _check_loss(loss: Any, what: str) -> torch.Tensor:
    """``loss`` if it is a one-element tensor (what ``backward`` without a gradient needs)."""
    if not isinstance(loss, torch.Tensor):
        raise ConfigError(f"engine.{what}(loss) needs a tensor, got {type(loss).__name__}")
    if loss.numel() != 1:
        raise ConfigError(
            f"engine.{what}(loss) needs a scalar loss, got shape {tuple(loss.shape)}; reduce "
            "it first, e.g. loss.mean() (or loss.sum())"
        )
    return loss


class DeepShardEngine(
    EngineCheckpointing,
    EngineReads,
    EngineStates,
    EngineFeatures,
    EngineWeights,
    EngineCompile,
    torch.nn.Module,
):
    """The training engine `deepshard.engine.initialize` returns.

    Attributes:
        global_rank: This process's rank in the world.
        local_rank: Its rank on this node (the device index).
        world_size: The number of processes.
        device: Where the model lives.
        training_dataloader: The loader ``initialize`` built from ``training_data`` (None
            without one); checkpoints store its position.

    Args:
        module: The model (already cast and on its device).
        parts: The components `initialize` built.
        compiled_forward: What the forward calls instead of ``module`` when the model came
            compiled (``torch.compile(model)``; ``module`` is then the model it wraps).
    """

    _compiled_forward: Callable[..., Any] | None

    def __init__(
        self,
        module: torch.nn.Module,
        parts: EngineParts,
        *,
        compiled_forward: Callable[..., Any] | None = None,
    ) -> None:
        super().__init__()
        self.module = module
        # a plain attribute, not a registered submodule: the wrapper's parameters are module's
        self.__dict__["_compiled_forward"] = compiled_forward
        self._is_compiled = compiled_forward is not None
        self.parts = parts
        self.optimizer = parts.optimizer
        self.lr_scheduler = parts.lr_scheduler
        self.loss_scaler = parts.loss_scaler
        self.accumulation = parts.accumulation
        self.comms_logger = parts.comms_logger
        self.parallel_dims = parts.dims
        self.mesh = parts.dims.mesh
        self.device = parts.device
        self.global_rank = parts.world.rank
        self.local_rank = parts.world.local_rank
        self.world_size = parts.world.world_size
        self._timers = parts.reporter.timers
        self._step_applied = False
        self._grad_norm: float | None = None
        self._in_no_sync = False
        self._destroyed = False
        self.training_dataloader: Any = None  # `initialize` sets the loader it built
        self._pending_save = None  # a background checkpoint save (checkpoint.async_save)
        self._load_failure: str | None = None  # a load_checkpoint that failed while filling
        self._plain_backward = PlainBackward(lambda: self.loss_scaler.scale)
        self._tp_inputs = TpInputCheck(parts.dims, parts.device)
        self._save_prepared = False  # its host buffers were readied (after the first step)
        self._declare_boundary()

    def __getattr__(self, name: str) -> Any:
        """Engine attributes, then a named refusal for a DeepSpeed name left out, then the
        module's own attributes (``engine.generate``, ``engine.config``,
        ``engine.gradient_checkpointing_enable()``), as DeepSpeed's engine falls back to its
        module."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            message = refused_attribute_message(type(self).__name__, name)
            if message is not None:
                raise AttributeError(message, name=name, obj=self) from None
            module = self.__dict__.get("_modules", {}).get("module")
            if module is None or name.startswith("__"):
                raise
            try:
                return getattr(module, name)
            except AttributeError:
                raise AttributeError(
                    f"{type(self).__name__!r} object has no attribute {name!r}, and neither "
                    f"has its module ({type(module).__name__})",
                    name=name,
                    obj=self,
                ) from None

    # --- the training loop ----------------------------------------------------------------

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the module's forward (under autocast / with fp16 inputs, and with the saved
        activations offloaded to the host, when configured)."""
        precision = self.parts.precision
        self._require_loaded("engine.forward()")
        if self.optimizer is not None:  # offloaded parameters are empty
            self.optimizer.check_resident("engine.forward()")
        self.parts.profiling.before_forward(self.global_steps)
        offload = self.parts.config.activation_checkpointing.cpu_checkpointing
        saved_tensors = offload_saved_tensors() if offload else contextlib.nullcontext()
        with (
            self._timers.time("forward"),
            precision.forward_context(self.device.type),
            saved_tensors,
        ):
            self._random_ltd_update()
            args, kwargs = precision.inputs(*self._curriculum_inputs(args, kwargs))
            self._tp_inputs(args, kwargs)  # once: TP peers must get the same batch
            if self._compiled_forward is not None:
                output = self._compiled_forward(*args, **kwargs)
            else:
                output = self.module(*args, **kwargs)
        return self._plain_backward.watch(output) if self.optimizer is not None else output

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
            ConfigError: The engine has no optimizer, or ``loss`` is not a scalar.
        """
        _check_loss(loss, "backward")
        zero = self._require_optimizer("backward")
        self.parts.reporter.add_loss(loss)
        accumulated = loss / self.gradient_accumulation_steps() if scale_wrt_gas else loss
        self.accumulation.backwards += 1
        with self._timers.time("backward"), self._plain_backward.engine_backward():
            zero.backward(
                self.scale(accumulated),
                is_boundary=self.is_gradient_accumulation_boundary(),
                retain_graph=retain_graph,
            )
        return accumulated

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` times the current loss scale (itself when the scale is 1).

        For a plain backward pass under fp16: ``engine.scale(loss).backward()``; the division by
        ``gradient_accumulation_steps`` happens at the boundary, as for ``loss.backward()``
        (see `deepshard.engine._plain_backward`).

        Raises:
            ConfigError: ``loss`` is not a scalar.
        """
        _check_loss(loss, "scale")
        self._plain_backward.scaled()
        scale = self.loss_scaler.scale
        return loss if scale == 1.0 else loss.float() * scale

    def step(self, lr_kwargs: dict[str, Any] | None = None) -> None:
        """End one micro-step; at the accumulation boundary, apply (or skip) the update.

        With ``managed_gradient_accumulation: false`` every call is the boundary: it ends the
        cycle of the backward passes since the last one (ZeRO reduces what stages 0-1
        accumulated locally) and applies the update.

        Args:
            lr_kwargs: Keyword arguments for the scheduler's ``step`` after an applied update
                (DeepSpeed's ``step(lr_kwargs=...)``, e.g. Megatron's ``{"increment": n}``).

        Raises:
            ConfigError: The engine has no optimizer, or gradients overflow at
                ``fp16.min_loss_scale``.
            CommError: No boundary backward pass preceded the boundary's step, or the call
                is inside ``no_sync()``.
        """
        zero = self._require_optimizer("step")
        self._require_loaded("engine.step()")
        if self._in_no_sync:
            raise CommError(
                "engine.step() was called inside engine.no_sync(); leave the block first (its "
                "backward passes only accumulate, the step belongs to the boundary pass after it)"
            )
        if not self.accumulation.managed:  # the caller's boundary: this call
            zero.end_accumulation()
            self.accumulation.stepping = True
        loss_scale = self.loss_scaler.scale  # the scale this step's gradients carry
        try:
            boundary = self._step_at_boundary(zero, loss_scale, lr_kwargs or {})
        finally:
            self.accumulation.stepping = False
        self._declare_boundary()
        if boundary:
            self.parts.profiling.after_step(self.global_steps - 1, self._timers.end_step())
            self.parts.reporter.end_step(
                step=self.global_steps,
                lrs=self.get_lr(),
                grad_norm=self._grad_norm,
                loss_scale=loss_scale,
            )

    def _step_at_boundary(
        self, zero: ZeroOptimizer, loss_scale: float, lr_kwargs: dict[str, Any]
    ) -> bool:
        """Apply (or skip) the update if this micro-step ends the cycle; count the micro-step.
        Returns whether it ended the cycle."""
        boundary = self.is_gradient_accumulation_boundary()
        self._step_applied = False
        if boundary:
            plain = self._plain_backward.boundary_factor(self.gradient_accumulation_steps())
            with self._timers.time("step"):
                with self._batch_scaled_lr():  # dynamic batching: this step's sample count
                    result = zero.step(loss_scale=loss_scale * plain)
                self.loss_scaler.update(result.overflow)
                self._step_applied = not result.overflow
                self._grad_norm = result.grad_norm
                if self._step_applied and self.lr_scheduler is not None:
                    self.lr_scheduler.step(**lr_kwargs)
            if self._step_applied:
                self._prepare_background_save()
        self.accumulation.advance(applied=self._step_applied)
        return boundary

    def _declare_boundary(self) -> None:
        """Tell ZeRO whether the coming backward pass ends the accumulation cycle (so a plain
        ``loss.backward()`` reduces exactly at the boundary)."""
        if self.optimizer is not None:
            self.optimizer.set_boundary(self.is_gradient_accumulation_boundary())

    def _require_optimizer(self, what: str, *, resident: bool = True) -> ZeroOptimizer:
        if self._destroyed:
            raise CommError(
                f"engine.{what}() was called after engine.destroy(); build a new engine with "
                "deepshard.engine.initialize"
            )
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
        if resident:
            self.optimizer.check_resident(f"engine.{what}()")
        return self.optimizer

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside only accumulate gradients (no boundary, no update).

        Raises:
            CommError: ``no_sync()`` is already active (nesting is refused, as in DeepSpeed).
        """
        zero = self._require_optimizer("no_sync")
        if self._in_no_sync:
            raise CommError(
                "engine.no_sync() is already active; nested no_sync() blocks are not supported, "
                "use one block around all the accumulating backward passes"
            )
        self._in_no_sync = True
        try:
            with zero.no_sync():
                yield
        finally:
            self._in_no_sync = False

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the gradients accumulated since the last step (ZeRO always frees them)."""
        self._require_optimizer("zero_grad").zero_grad(set_to_none)

    def set_gradient_accumulation_boundary(self, is_boundary: bool | None) -> None:
        """Declare whether the coming backward pass and ``step()`` end an accumulation cycle.

        As DeepSpeed's: the declaration stands until changed, replacing the micro-step
        counter, so a loop can set False, run its accumulating passes, set True, run the last
        pass and call ``step()`` once. ``None`` hands the decision back to the counter.

        Raises:
            ConfigError: ``managed_gradient_accumulation`` is false (``step()`` is the boundary).
        """
        if not self.accumulation.managed:
            raise ConfigError.from_problems(
                [
                    (
                        "managed_gradient_accumulation",
                        "false: every step() ends the accumulation cycle, so there is no "
                        "boundary to declare; remove the call or set the key to true",
                    )
                ]
            )
        self.accumulation.override = is_boundary
        self._declare_boundary()

    def is_gradient_accumulation_boundary(self) -> bool:
        """Whether the current micro-step's ``step()`` will apply an update."""
        return self.accumulation.is_boundary()

    def was_step_applied(self) -> bool:
        """Whether the last ``step()`` applied an update (False off-boundary or on overflow)."""
        return self._step_applied

    def destroy(self) -> None:
        """Detach ZeRO from the module and drop its gradients; the engine cannot train after.

        The module keeps its trained weights and can be wrapped again. The process group is
        left alone (other engines may use it): ``torch.distributed.destroy_process_group()``
        ends it. Calling ``destroy`` twice does nothing.
        """
        if self._destroyed:
            return
        if self.optimizer is not None:
            if self.optimizer.offloaded_states:  # give the memory back before letting go
                self.optimizer.reload_states()
            self.optimizer.zero_grad()
            self.optimizer.remove_hooks()
            self.optimizer.close()  # offloaded state: NVMe swap files are removed
        self._destroyed = True

    def generation_context(
        self, *, gather_units: int = 1
    ) -> contextlib.AbstractContextManager[GenerationView]:
        """Generate from the training weights inside (a rollout between steps): eval mode,
        at stage 3 at most ``gather_units`` units gathered at once; the training state, modes
        and RNG are as before on exit (`deepshard.engine._generation`)."""
        return generation_context(self, gather_units=gather_units)
