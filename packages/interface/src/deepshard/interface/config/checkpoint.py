"""`checkpoint`: tag validation, universal loading and the checkpoint writer."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from deepshard.interface.config._base import ConfigModel

__all__ = ["CheckpointConfig", "CheckpointWriterConfig", "ParallelWriteConfig"]


def _upper(value: object) -> object:
    return value.upper() if isinstance(value, str) else value


class ParallelWriteConfig(ConfigModel):
    """`checkpoint.parallel_write`."""

    config_key = "checkpoint.parallel_write"

    pipeline_stage: bool = False
    """Let every pipeline stage write its own part of the checkpoint in parallel."""


class CheckpointWriterConfig(ConfigModel):
    """`checkpoint.writer`: how checkpoint bytes reach storage."""

    config_key = "checkpoint.writer"

    type: Literal["FAST", "PYTHON", "MOCK"] = "FAST"
    """Writer: FAST (asynchronous, pinned buffers), PYTHON (plain file writes), MOCK (no I/O, for
    tests). Case-insensitive."""

    decoupled: bool = False
    """Write in a background process, decoupled from training."""

    io_buffer_size: int = Field(64 * 1024**2, gt=0)
    """Bytes per I/O buffer of the FAST writer."""

    io_buffer_double: bool = True
    """Double-buffer I/O so copying and writing overlap."""

    show_statistics: bool = False
    """Print write bandwidth statistics."""

    data_parallel: Literal["REPLICA", "SOCKET", "MACHINE"] | None = None
    """Which data-parallel ranks share the writing: one per replica, socket or machine."""

    io_multiplier: int = Field(1, ge=1)
    """Scale factor of the I/O parallelism."""

    @field_validator("type", "data_parallel", mode="before")
    @classmethod
    def _case_insensitive(cls, value: object) -> object:
        return _upper(value)


class CheckpointConfig(ConfigModel):
    """The `checkpoint` section."""

    config_key = "checkpoint"

    tag_validation: Literal["WARN", "IGNORE", "FAIL"] = "WARN"
    """What to do when ranks save under different tags: warn, ignore or fail (any case)."""

    load_universal: bool = False
    """Load a universal (topology-independent) checkpoint, resharding to the current topology."""

    use_node_local_storage: bool = False
    """Each node saves to and loads from its own local disk (no shared filesystem)."""

    parallel_write: ParallelWriteConfig = Field(default_factory=ParallelWriteConfig)
    """Parallel checkpoint writing."""

    checkpoint_serialization: bool = True
    """DeepSpeed's torch.save zip-serialization switch, accepted for compatibility; DeepShard
    always writes safetensors."""

    writer: CheckpointWriterConfig | None = None
    """Checkpoint writer; None uses the default writer."""

    async_save: bool = False
    """DeepShard: ``engine.save_checkpoint`` copies the state to host memory and writes it on a
    background thread while training continues; the next save, a load or process exit waits
    for it, and its error surfaces at the next save."""

    keep_last: int | None = Field(None, ge=1)
    """DeepShard: after each successful save keep only this many complete checkpoints in the
    directory (never the one ``latest`` names); None keeps every one."""

    @field_validator("tag_validation", mode="before")
    @classmethod
    def _case_insensitive(cls, value: object) -> object:
        return _upper(value)
