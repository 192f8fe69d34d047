"""`sequence_parallel`: how Ulysses sequence parallelism treats a Hugging Face model (ALST).

The degree itself is DeepSpeed's top-level ``sequence_parallel_size`` (Topology ``sp``); this
DeepShard section holds what DeepSpeed passes to ``register_with_transformers`` as arguments,
and the switches of the tiled compute DeepSpeed's ALST tutorial applies by hand (tiled MLP,
tiled logits + loss).
"""

from __future__ import annotations

from pydantic import Field

from deepshard.interface.config._base import ConfigModel

__all__ = ["SequenceParallelConfig"]


class SequenceParallelConfig(ConfigModel):
    """The ``sequence_parallel`` section (a DeepShard key). ``disable_in_eval`` matters when
    ``sequence_parallel_size`` is above 1; the tiled compute switches apply at any size."""

    disable_in_eval: bool = False
    """In ``model.eval()`` mode run the model's plain attention and loss, for evaluation on
    whole (unsharded) batches, as DeepSpeed's ``disable_in_eval``."""

    tiled_mlp: bool = False
    """Compute every decoder layer's MLP a slice of tokens at a time, recomputed in backward
    (Hugging Face Llama, Mistral, Qwen2, Qwen3)."""

    tiled_mlp_shards: int | None = Field(None, ge=1)
    """Slices per MLP call; None: ``ceil(tokens / hidden_size)``, DeepSpeed's "auto"."""

    tiled_logits_loss: bool = False
    """Compute ``lm_head`` and the cross-entropy a slice of tokens at a time when labels are
    given, so the whole logits never exist (the model then returns ``logits=None``)."""

    tiled_logits_shards: int | None = Field(None, ge=1)
    """Slices of the logits loss; None: enough that one slice's fp32 logits hold at most 2^24
    values (64 MiB)."""
