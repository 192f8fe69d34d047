"""The top-level scalar settings of a DeepSpeed config (sections live in DeepShardConfig)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from deepshard.interface.config._base import ConfigModel
from deepshard.interface.config._dtypes import DtypeName, normalize_dtype

__all__ = ["TopLevelSettings"]


def _lower(value: object) -> object:
    return value.lower() if isinstance(value, str) else value


class TopLevelSettings(ConfigModel):
    """Batch sizes, gradient handling and logging switches at the top level of the config."""

    train_batch_size: int | None = Field(None, gt=0)
    """Samples per optimizer step over all data-parallel ranks; derived when omitted."""

    train_micro_batch_size_per_gpu: int | None = Field(None, gt=0)
    """Samples per forward/backward pass on one rank; derived when omitted."""

    gradient_accumulation_steps: int | None = Field(None, gt=0)
    """Micro-batches accumulated before each optimizer step; derived when omitted."""

    managed_gradient_accumulation: bool = True
    """Let the engine decide accumulation boundaries from its micro-step counter (false: every
    ``engine.step()`` ends the cycle of the backward passes before it, however many)."""

    steps_per_print: int | None = Field(None, ge=1)
    """Log a progress line every this many steps; None (DeepSpeed's default) logs none."""

    dump_state: bool = False
    """Print the engine state after initialisation."""

    disable_allgather: bool = False
    """Broadcast updated parameters instead of all-gathering them (legacy ZeRO-1 switch)."""

    communication_data_type: DtypeName | None = None
    """Dtype gradients are reduced in; None uses the training dtype."""

    seq_parallel_communication_data_type: DtypeName | None = "fp32"
    """Dtype of sequence-parallel all-to-all traffic."""

    prescale_gradients: bool = False
    """Divide gradients by the world size before reducing (instead of after)."""

    gradient_predivide_factor: float = Field(1.0, gt=0.0)
    """Divide gradients by this before reducing and by world/factor after (overflow control)."""

    gradient_allreduce_op: Literal["mean", "sum"] = "mean"
    """Average or sum gradients over data-parallel ranks ("sum" is not allowed with stage 3)."""

    sparse_gradients: bool = False
    """Reduce the gradients of ``nn.Embedding(sparse=True)`` as sparse tensors."""

    gradient_clipping: float = Field(1.0, ge=0.0)
    """Clip the global gradient norm to this value; 0 disables clipping."""

    graph_harvesting: bool = False
    """Capture the optimizer step in a device graph (CUDA graphs) where supported."""

    zero_allow_untested_optimizer: bool = False
    """Allow ZeRO with an optimizer outside the tested list."""

    zero_force_ds_cpu_optimizer: bool = True
    """With optimizer offload, require DeepShard's CPU optimizer (refuse a plain torch one)."""

    wall_clock_breakdown: bool = False
    """Time forward, backward and step separately (also turned on by the flops profiler)."""

    memory_breakdown: bool = False
    """Log device memory use at each phase of the step."""

    use_data_before_expert_parallelism: bool = False
    """Order ranks data-parallel first, then expert-parallel, when carving expert groups."""

    dataloader_drop_last: bool = False
    """Drop the last incomplete batch of the engine-built data loader."""

    log_level: Literal["debug", "info", "warning", "error", "critical"] | None = None
    """Log level of DeepShard's loggers (any case); None leaves it unchanged."""

    vocabulary_size: int | None = Field(None, ge=1)
    """Model vocabulary size; only used to warn when it is not a multiple of 8."""

    sequence_parallel_size: int = Field(1, ge=1)
    """Ulysses sequence-parallel degree (Topology ``sp``)."""

    @field_validator(
        "communication_data_type", "seq_parallel_communication_data_type", mode="before"
    )
    @classmethod
    def _canonical_dtype(cls, value: object) -> object:
        return normalize_dtype(value)

    @field_validator("gradient_allreduce_op", "log_level", mode="before")
    @classmethod
    def _case_insensitive(cls, value: object) -> object:
        return _lower(value)
