"""`sequence_parallel`: how Ulysses sequence parallelism treats a Hugging Face model (ALST).

The degree itself is DeepSpeed's top-level ``sequence_parallel_size`` (Topology ``sp``); this
DeepShard section holds what DeepSpeed passes to ``register_with_transformers`` as arguments.
"""

from __future__ import annotations

from deepshard.interface.config._base import ConfigModel

__all__ = ["SequenceParallelConfig"]


class SequenceParallelConfig(ConfigModel):
    """The ``sequence_parallel`` section (a DeepShard key; read when ``sequence_parallel_size``
    is above 1)."""

    disable_in_eval: bool = False
    """In ``model.eval()`` mode run the model's plain attention and loss, for evaluation on
    whole (unsharded) batches, as DeepSpeed's ``disable_in_eval``."""
