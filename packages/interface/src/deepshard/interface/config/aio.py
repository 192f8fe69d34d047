"""`aio`: asynchronous I/O used by NVMe offload and checkpoint writing."""

from __future__ import annotations

from pydantic import AliasChoices, Field

from deepshard.interface.config._base import ConfigModel

__all__ = ["AioConfig"]


class AioConfig(ConfigModel):
    """The `aio` section: how NVMe swap files are read and written."""

    config_key = "aio"

    block_size: int = Field(1_048_576, gt=0)
    """Bytes per I/O request."""

    queue_depth: int = Field(8, ge=1)
    """Requests in flight per thread."""

    intra_op_parallelism: int = Field(
        1,
        ge=1,
        validation_alias=AliasChoices("intra_op_parallelism", "thread_count"),
        serialization_alias="intra_op_parallelism",
    )
    """Threads that split one read or write (DeepSpeed's older spelling: `thread_count`).

    DeepSpeed 0.19.7 reads only `intra_op_parallelism` and drops `thread_count` without a word,
    so a config that still says `"thread_count": 4` (as the NVMe offload examples of the
    Hugging Face docs do) gets 1 thread there; DeepShard reads it as the threads it asks for.
    """

    single_submit: bool = False
    """Submit requests one at a time instead of batched."""

    overlap_events: bool = True
    """Overlap request submission with completion handling."""

    use_gds: bool = False
    """Use NVIDIA GPUDirect Storage (CUDA only)."""
