"""`zero_optimization.offload_optimizer` / `offload_param`: moving ZeRO state to CPU or NVMe."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from deepshard.interface.config._base import ConfigModel, raw_problems_error

__all__ = ["OffloadDevice", "OffloadOptimizerConfig", "OffloadParamConfig"]

OffloadDevice = Literal["none", "cpu", "nvme"]
"""Where offloaded state lives: nowhere (no offload), host memory, or NVMe files."""


def _needs_nvme_path(device: str, nvme_path: Path | None) -> None:
    if device == "nvme" and nvme_path is None:
        message = 'device "nvme" needs nvme_path, the directory the swap files go to'
        raise raw_problems_error([("nvme_path", message)])


class OffloadOptimizerConfig(ConfigModel):
    """Offload of optimizer state (and the optimizer step) to CPU or NVMe; ZeRO stages 1-3."""

    config_key = "zero_optimization.offload_optimizer"
    drops_auto = True

    device: OffloadDevice = "none"
    """Where the optimizer state lives; the step itself runs on the CPU for "cpu" and "nvme"."""

    nvme_path: Path | None = None
    """Directory for the NVMe swap files; required when ``device`` is "nvme"."""

    buffer_count: int = Field(4, ge=0)
    """Swap buffers for NVMe offload; at least the number of states per parameter (4 for Adam)."""

    pin_memory: bool = True
    """Use page-locked host buffers (fast asynchronous copies; needs a large ``ulimit -l``)."""

    pipeline_read: bool = False
    """With NVMe, read the next sub-group's state while the current one is being updated."""

    pipeline_write: bool = False
    """With NVMe, write the previous sub-group's state while the current one is being updated."""

    fast_init: bool = False
    """Skip zero-filling NVMe swap files at start-up."""

    ratio: float = Field(1.0, ge=0.0, le=1.0)
    """Fraction of the optimizer state offloaded; below 1.0 only with ZeRO stage 3."""

    super_offload: bool = False
    """DeepSpeed's Superchip (Grace-Hopper) offload mode; stage 3 only."""

    cpuadam_cores_perc: float = Field(0.8, ge=0.0, le=1.0)
    """Fraction of CPU cores the CPU optimizer uses in ``super_offload`` mode."""

    @model_validator(mode="after")
    def _nvme_path_given(self) -> OffloadOptimizerConfig:
        _needs_nvme_path(self.device, self.nvme_path)
        return self

    @property
    def pipeline(self) -> bool:
        """Whether NVMe reads or writes overlap the optimizer step."""
        return self.pipeline_read or self.pipeline_write


class OffloadParamConfig(ConfigModel):
    """Offload of partitioned parameters to CPU or NVMe; ZeRO stage 3 only."""

    config_key = "zero_optimization.offload_param"
    drops_auto = True

    device: OffloadDevice = "none"
    """Where the parameter partitions live between uses."""

    nvme_path: Path | None = None
    """Directory for the NVMe swap files; required when ``device`` is "nvme"."""

    buffer_count: int = Field(5, ge=0)
    """Swap buffers in the NVMe parameter pool."""

    buffer_size: int = Field(100_000_000, ge=0)
    """Elements per swap buffer in the NVMe parameter pool."""

    max_in_cpu: int = Field(1_000_000_000, ge=0)
    """Parameter elements kept in host memory when offloading to NVMe."""

    pin_memory: bool = True
    """Use page-locked host buffers (fast asynchronous copies; needs a large ``ulimit -l``)."""

    @model_validator(mode="after")
    def _nvme_path_given(self) -> OffloadParamConfig:
        _needs_nvme_path(self.device, self.nvme_path)
        return self
