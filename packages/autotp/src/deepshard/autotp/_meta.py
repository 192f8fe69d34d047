"""`AutoTPMeta`: what AutoTP needs to know about one model, read once from its config.

Every sharding decision that depends on the architecture (how many KV-head groups a projection
is cut into, the grain of an MLP split, which fused layout a QKV has) reads one frozen
`AutoTPMeta` built from *that* model's config. It is an argument, never module state, so two
models with different head counts in one process (teacher and student, actor and reference)
plan independently: DeepSpeed v0.19.7 fixed exactly this by replacing its process-global
``tp_shard`` values with a per-model object.

Configs are read by duck typing (no transformers import): each field is probed under the
names the model families use, and a multimodal config's ``text_config`` is where the language
model's head counts live.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from deepshard.interface.errors import ConfigError

__all__ = ["AutoTPMeta"]

_HEADS = ("num_attention_heads", "n_head", "num_heads", "n_heads", "attention_heads")
# chatglm's multi_query_group_num, Falcon's legacy n_head_kv and DBRX's kv_n_heads besides the
# canonical names; a model that has none of them is plain multi-head (kv == q heads).
_KV_HEADS = (
    "num_key_value_heads",
    "num_kv_heads",
    "multi_query_group_num",
    "n_head_kv",
    "kv_n_heads",
)
_HEAD_DIM = ("head_dim", "kv_channels")
_HIDDEN = ("hidden_size", "n_embd", "d_model")
_INTERMEDIATE = ("intermediate_size", "ffn_hidden_size", "n_inner", "ffn_dim")
_VOCAB = ("vocab_size", "padded_vocab_size")


def _probe(config: Any, names: tuple[str, ...]) -> int | None:
    """The first of ``names`` that ``config`` has as a positive integer, else None."""
    for name in names:
        value = getattr(config, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


@dataclass(frozen=True)
class AutoTPMeta:
    """Per-model tensor-parallel metadata, derived from the model's config.

    Build it with `from_model_config`; a model without a config gets the empty meta (every
    split then follows the grain).
    """

    num_attention_heads: int | None = None
    """Query heads per attention layer; None when the config does not say."""

    num_kv_heads: int | None = None
    """Key/value heads (the GQA groups); equal to the query heads for plain multi-head
    attention; None when the head count is unknown."""

    head_dim: int | None = None
    """Features per head: the config's ``head_dim``, else ``hidden_size // heads``."""

    hidden_size: int | None = None
    """Width of the residual stream."""

    intermediate_size: int | None = None
    """Width of the MLP's hidden layer."""

    vocab_size: int | None = None
    """Rows of the input embedding and the LM head."""

    model_type: str | None = None
    """The config's ``model_type`` (``"llama"``); matched by layer specs' ``model_types``."""

    tp_grain_size: int = 1
    """Rows a split that does not follow heads is rounded to (``tensor_parallel.tp``)."""

    @classmethod
    def from_model_config(cls, config: Any, tp_grain_size: int = 1) -> AutoTPMeta:
        """Reads a model config (a Hugging Face ``PretrainedConfig`` or anything shaped like one).

        Args:
            config: The model's config, or None for a model without one.
            tp_grain_size: ``tensor_parallel.tp.tp_grain_size``.

        Returns:
            The meta; fields the config does not carry are None.

        Raises:
            ConfigError: When the head counts contradict each other (query heads not a multiple
                of the KV heads): no split can keep every query head with its KV head.
        """
        if tp_grain_size < 1:
            raise ConfigError(
                f"tensor_parallel.tp.tp_grain_size: {tp_grain_size} must be at least 1",
                [("tensor_parallel.tp.tp_grain_size", "must be at least 1")],
            )
        if config is None:
            return cls(tp_grain_size=tp_grain_size)
        model_type = getattr(config, "model_type", None)
        text = getattr(config, "text_config", None)
        text = config if text is None else text
        heads = _probe(text, _HEADS)
        kv_heads = _probe(text, _KV_HEADS) or heads
        hidden = _probe(text, _HIDDEN)
        head_dim = _probe(text, _HEAD_DIM)
        if head_dim is None and heads is not None and hidden is not None and hidden % heads == 0:
            head_dim = hidden // heads
        if heads is not None and kv_heads is not None and heads % kv_heads:
            raise ConfigError(
                f"the model config has {heads} attention heads and {kv_heads} key/value heads: "
                "query heads must be a multiple of the key/value heads for AutoTP to keep each "
                "query head with its KV head; fix the model config"
            )
        return cls(
            num_attention_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            hidden_size=hidden,
            intermediate_size=_probe(text, _INTERMEDIATE),
            vocab_size=_probe(text, _VOCAB),
            model_type=model_type if isinstance(model_type, str) else None,
            tp_grain_size=tp_grain_size,
        )

    @property
    def q_rows(self) -> int | None:
        """Rows of a query projection (heads × head_dim), when both are known."""
        if self.num_attention_heads is None or self.head_dim is None:
            return None
        return self.num_attention_heads * self.head_dim

    @property
    def kv_rows(self) -> int | None:
        """Rows of a key (or value) projection (KV heads × head_dim), when both are known."""
        if self.num_kv_heads is None or self.head_dim is None:
            return None
        return self.num_kv_heads * self.head_dim
