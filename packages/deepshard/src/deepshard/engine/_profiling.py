"""The ``flops_profiler`` config block in training: one step profiled on rank 0.

At the first forward pass of global step ``profile_step`` (counted from 0, as in DeepSpeed)
rank 0 starts a `deepshard.profiler.FlopsProfiler` that counts forward and backward operators;
when that step's optimizer step has run, the profile is printed (or written to
``output_file``) with the step's forward, backward and step latencies from the engine's
wall-clock timers, the samples per second and the TFLOPS per device, then profiling ends. The
other ranks never profile, so they pay nothing. ``recompute_fwd_factor`` is taken off the
counted FLOPs for the utilisation (recomputed forwards are counted in backward).

The operators are counted from a fake-tensor replay of the step's forward calls when the
profile is printed (``count_mode="auto"``), so the latencies printed are those of an unslowed
step; at ZeRO stage 3, whose hooks gather parameters, they are counted eagerly. When the replay
fails (shapes that depend on values), the next step is profiled instead, counted eagerly.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from deepshard.interface import BatchSizes
from deepshard.interface.config import FlopsProfilerConfig
from deepshard.profiler import (
    CountMode,
    FlopsProfiler,
    ProfilerReplayError,
    StepTimes,
    TrainingStep,
)

__all__ = ["StepProfiling"]

_log = logging.getLogger("deepshard.engine")


class StepProfiling:
    """Starts, prints and ends the FLOPs profile of the configured step.

    Args:
        config: The ``flops_profiler`` section.
        module: The model.
        rank: This process's global rank (only rank 0 profiles).
        world_size: Ranks in the job.
        dp_size: Ranks reading different samples.
        batch: The reconciled batch sizes.
        param_numel: The elements a parameter stands for in the profile's parameter counts
            (the full size of a ZeRO stage-3 parameter); ``numel()`` by default.
        count_mode: How the profiler counts; ``"eager"`` where a replay must not run the
            model's hooks again (ZeRO stage 3 gathers parameters in them).
    """

    def __init__(
        self,
        config: FlopsProfilerConfig,
        *,
        module: torch.nn.Module,
        rank: int,
        world_size: int,
        dp_size: int,
        batch: BatchSizes,
        param_numel: Callable[[torch.nn.Parameter], int] | None = None,
        count_mode: CountMode = "auto",
    ) -> None:
        self.config = config
        self._active = config.enabled and rank == 0
        self._world_size = world_size
        self._dp_size = dp_size
        self._batch = batch
        self.profile_step = config.profile_step
        """The step profiled: the configured one, or a later one when a replay failed."""
        self.profiler: FlopsProfiler | None = None
        if self._active:
            self.profiler = FlopsProfiler(
                module,
                count_backward=True,
                recompute_fwd_factor=config.recompute_fwd_factor,
                param_numel=param_numel,
                count_mode=count_mode,
            )

    def before_forward(self, global_step: int) -> None:
        """Start profiling at the first forward pass of the profile step."""
        prof = self.profiler
        if prof is not None and global_step == self.profile_step and not prof.started:
            prof.start_profile()

    def after_step(self, finished_step: int, times: StepTimes) -> None:
        """After the profile step's optimizer step: print the profile and stop.

        Args:
            finished_step: The global step that just ended (counted from 0).
            times: Its phase times from the engine's timers.
        """
        prof = self.profiler
        if prof is None or not prof.started or finished_step != self.profile_step:
            return
        prof.stop_profile()
        try:
            prof.profile()  # counts now (the replay)
        except ProfilerReplayError as error:
            _log.warning("%s: profiling step %d instead", error, finished_step + 1)
            prof.end_profile()
            self.profile_step = finished_step + 1  # the profiler now counts eagerly
            return
        cfg = self.config
        training = TrainingStep(
            world_size=self._world_size,
            dp_size=self._dp_size,
            micro_batch_per_device=self._batch.train_micro_batch_size_per_gpu,
            micro_steps=self._batch.gradient_accumulation_steps,
            forward_s=times.forward_s,
            backward_s=times.backward_s,
            step_s=times.step_s,
            recompute_fwd_factor=cfg.recompute_fwd_factor,
        )
        try:
            prof.print_model_profile(
                profile_step=finished_step,
                module_depth=cfg.module_depth,
                top_modules=cfg.top_modules,
                detailed=cfg.detailed,
                output_file=cfg.output_file,
                training=training,
            )
        finally:
            prof.end_profile()
            self.profiler = None  # one profile per run
