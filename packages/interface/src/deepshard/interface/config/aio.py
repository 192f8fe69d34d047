"""`aio`: asynchronous I/O used by NVMe offload and checkpoint writing."""

from __future__ import annotations

from pydantic import Field

from deepshard.interface.config._base import ConfigModel

__all__ = ["AioConfig"]


class AioConfig(ConfigModel):
    """The `aio` section: how NVMe swap files are read and written."""

    config_key = "aio"

    block_size: int = Field(1_048_576, gt=0)
    """Bytes per I/O request."""

    queue_depth: int = Field(8, ge=1)
    """Requests in flight per thread."""

    intra_op_parallelism: int = Field(1, ge=1)
    """Threads that split one read or write."""

    single_submit: bool = False
    """Submit requests one at a time instead of batched."""

    overlap_events: bool = True
    """Overlap request submission with completion handling."""

    use_gds: bool = False
    """Use NVIDIA GPUDirect Storage (CUDA only)."""
