"""`flops_profiler` and `timers`: FLOPs/latency profiling and throughput timing."""

from __future__ import annotations

from pydantic import Field

from deepshard.interface.config._base import ConfigModel

__all__ = ["FlopsProfilerConfig", "ThroughputTimerConfig", "TimersConfig"]


class FlopsProfilerConfig(ConfigModel):
    """The `flops_profiler` section: per-module FLOPs, parameters and latency at one step."""

    config_key = "flops_profiler"

    enabled: bool = False
    """Profile one training step (turns ``wall_clock_breakdown`` on as well)."""

    recompute_fwd_factor: float = Field(0.0, ge=0.0)
    """Extra forward passes per step from activation recomputation (0 none, 1 full), used to
    count the FLOPs of recomputation. Deliberate deviation: DeepSpeed sets no bound; a negative
    factor would report negative FLOPs, so DeepShard refuses it."""

    profile_step: int = Field(1, ge=0)
    """Global step (counted from 0, as in DeepSpeed) at which the profile is taken."""

    module_depth: int = Field(-1, ge=-1)
    """Depth of the module tree printed; -1 prints every level. Deliberate deviation: DeepSpeed
    sets no bound; DeepShard refuses depths below -1, which have no meaning."""

    top_modules: int = Field(1, ge=1)
    """Modules listed per depth in the aggregated summary. Deliberate deviation: DeepSpeed sets
    no bound; DeepShard refuses values below 1, which would list nothing."""

    detailed: bool = True
    """Print the per-module breakdown, not only the totals."""

    output_file: str | None = None
    """File the profile is written to; None prints to stdout."""


class ThroughputTimerConfig(ConfigModel):
    """The `timers.throughput` section: samples-per-second timing."""

    config_key = "timers.throughput"
    drops_auto = True

    enabled: bool = True
    """Measure and report training throughput."""

    synchronized: bool = True
    """Synchronise the device before reading the clock (accurate, slightly slower)."""


class TimersConfig(ConfigModel):
    """The `timers` section."""

    config_key = "timers"

    throughput: ThroughputTimerConfig = Field(default_factory=ThroughputTimerConfig)
    """Throughput timer settings."""
