"""`activation_checkpointing`: recompute activations in the backward pass to save memory."""

from __future__ import annotations

from pydantic import Field

from deepshard.interface.config._base import ConfigModel

__all__ = ["ActivationCheckpointingConfig"]


class ActivationCheckpointingConfig(ConfigModel):
    """The `activation_checkpointing` section."""

    config_key = "activation_checkpointing"

    partition_activations: bool = False
    """Shard checkpointed activations across tensor-parallel ranks."""

    cpu_checkpointing: bool = False
    """Keep the activations the forward saves for backward in host memory until backward
    (the engine runs the forward under `deepshard.zero.offload_saved_tensors`). Works without
    ``partition_activations``, as in DeepSpeed 0.19.7; DeepShard offloads every saved
    activation (one copy per storage), not only the inputs of checkpointed layers."""

    contiguous_memory_optimization: bool = False
    """Copy checkpointed activations into one preallocated buffer (less fragmentation)."""

    number_checkpoints: int | None = Field(None, ge=1)
    """Checkpoints per forward, sizing the contiguous buffer; None if not known ahead.
    Deliberate deviation: DeepSpeed sets no bound; DeepShard refuses values below 1, which would
    size a buffer with no slot."""

    synchronize_checkpoint_boundary: bool = False
    """Synchronise the device at each checkpoint boundary (for debugging and timing)."""

    profile: bool = False
    """Log the time spent in checkpointed forward and recomputation."""
