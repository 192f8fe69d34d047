"""`sequence_parallel`: how Ulysses sequence parallelism treats a Hugging Face model (ALST).

The degree itself is DeepSpeed's top-level ``sequence_parallel_size`` (Topology ``sp``); this
DeepShard section holds what DeepSpeed passes to ``register_with_transformers`` as arguments,
and the switches of the tiled compute DeepSpeed's ALST tutorial applies by hand (tiled MLP,
tiled logits + loss).

LLaMA-Factory writes a block of the same name with its own keys (``enabled``, ``size``,
``mode``, ``ulysses``, ``tiling``, ``memory_optimizations``) into the DeepSpeed configs it
generates for ALST. DeepSpeed 0.19.7 has no ``sequence_parallel`` key and ignores that block,
so it is accepted here too and reported as having no effect: the degree is always
``sequence_parallel_size``.
"""

from __future__ import annotations

from typing import Any

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

    enabled: bool | None = None
    """LLaMA-Factory's switch; no effect (Ulysses runs when ``sequence_parallel_size`` > 1)."""

    size: int | None = None
    """LLaMA-Factory's degree; no effect (the degree is ``sequence_parallel_size``)."""

    mode: str | None = None
    """LLaMA-Factory's mode name; no effect (sequence parallelism here is Ulysses)."""

    ulysses: dict[str, Any] | None = None
    """LLaMA-Factory's Ulysses settings; no effect."""

    tiling: dict[str, Any] | None = None
    """LLaMA-Factory's tiling settings; no effect (use ``tiled_mlp`` / ``tiled_logits_loss``)."""

    memory_optimizations: dict[str, Any] | None = None
    """LLaMA-Factory's memory settings; no effect."""
