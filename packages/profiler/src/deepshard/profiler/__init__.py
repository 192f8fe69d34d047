"""DeepShard's FLOPs profiler and the training wall-clock breakdown.

``FlopsProfiler(model)`` has DeepSpeed's API (``start_profile``, ``get_total_flops``,
``print_model_profile``, ``end_profile`` ...) and counts at the aten level, so every way of
reaching a matrix product or an attention kernel is seen, forward and (optionally) backward,
attributed to the module tree, with per-module latency and, when the device's peak is known or
given, the model FLOPs utilisation. By default the operators are counted after the step,
from a replay of its calls on fake tensors, so the profiled step pays only the module hooks
(``count_mode="eager"`` counts while it runs). ``get_model_profile(model, input_shape=...)``
profiles one forward pass. ``WallClockTimers`` is the engine's forward/backward/reduce/step
breakdown.
"""

from __future__ import annotations

from deepshard.profiler._counting import ModuleTally
from deepshard.profiler._formulas import conv_macs, elementwise_flops, sdpa_macs
from deepshard.profiler._model_profile import get_model_profile
from deepshard.profiler._peak import PEAK_FLOPS, peak_flops_of
from deepshard.profiler._profiler import (
    CountMode,
    FlopsProfiler,
    ProfilerError,
    ProfilerReplayError,
)
from deepshard.profiler._report import (
    ModelProfile,
    ModuleProfile,
    TrainingStep,
    number_to_string,
)
from deepshard.profiler._timers import (
    GATHER_OPS,
    PHASES,
    CommRecordSource,
    GatherWaitSource,
    StepTimes,
    WallClockTimers,
)

__all__ = [
    "GATHER_OPS",
    "PEAK_FLOPS",
    "PHASES",
    "CommRecordSource",
    "CountMode",
    "FlopsProfiler",
    "GatherWaitSource",
    "ModelProfile",
    "ModuleProfile",
    "ModuleTally",
    "ProfilerError",
    "ProfilerReplayError",
    "StepTimes",
    "TrainingStep",
    "WallClockTimers",
    "conv_macs",
    "elementwise_flops",
    "get_model_profile",
    "number_to_string",
    "peak_flops_of",
    "sdpa_macs",
]
