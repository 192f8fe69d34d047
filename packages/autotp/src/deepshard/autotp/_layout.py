"""What module names and architectures say about a layer: attention or not, fused or not.

The plan sources decide a module's style; this module answers the questions that come after
and are the same for every source: does the module's split dimension run over attention heads
(so its shards follow KV-head groups), and is its weight several sub-parameters stacked along
that dimension (a fused gate/up, a fused QKV, whose layout depends on the architecture)?
"""

from __future__ import annotations

from deepshard.autotp._meta import AutoTPMeta
from deepshard.interface.errors import ConfigError

__all__ = ["FUSED_QKV", "fused_parts", "in_attention", "leaf", "parent"]

_ATTENTION_WORDS = ("attn", "attention")
_ATTENTION_LEAVES = frozenset(
    {"q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj", "query_key_value", "Wqkv", "q_b_proj",
     "kv_b_proj", "wq", "wk", "wv", "query", "key", "value"}
)  # fmt: skip

FUSED_QKV = frozenset({"qkv_proj", "query_key_value", "Wqkv", "qkv", "c_attn"})
"""Leaf names of projections that hold q, k and v in one weight."""

# Fused QKVs laid out head by head ([q0 k0 v0 q1 k1 v1 ...], or Falcon's per-KV-group blocks):
# a KV-group split of the whole weight already keeps each head together.
_INTERLEAVED_QKV = frozenset({"bloom", "falcon", "gpt_neox"})
_GLM = frozenset({"chatglm", "glm"})
_SPEC_KEY = "tensor_parallel.partition_config.layer_specs"


def leaf(name: str) -> str:
    """The last component of a module name (``"q_proj"`` of ``"model.layers.0.attn.q_proj"``)."""
    return name.rsplit(".", 1)[-1]


def parent(name: str) -> str:
    """The enclosing module's name (``""`` for a child of the root)."""
    return name.rsplit(".", 1)[0] if "." in name else ""


def in_attention(name: str) -> bool:
    """Whether the module belongs to an attention block, so its rows are whole heads."""
    components = name.lower().split(".")
    if any(word in part for part in components[:-1] for word in _ATTENTION_WORDS):
        return True
    return leaf(name) in _ATTENTION_LEAVES


def fused_parts(name: str, rows: int, meta: AutoTPMeta) -> tuple[int, ...]:
    """The sub-parameters stacked along a column-parallel weight's dim 0, by architecture.

    A ``gate_up_proj`` (and GLM's ``dense_h_to_4h``) is gate then up, two halves. A fused QKV
    is q, k, v concatenated (Phi-3, GLM, MPT) unless the architecture interleaves heads (Bloom,
    Falcon, GPT-NeoX), in which case the whole weight is one sub-parameter.

    Args:
        name: The module's name.
        rows: Its weight's dim 0.
        meta: The model's metadata (heads, head_dim, model_type).

    Returns:
        Each sub-parameter's rows; ``(rows,)`` for a plain projection.

    Raises:
        ConfigError: For a fused QKV whose layout cannot be told from the config.
    """
    short = leaf(name)
    gate_up = short == "gate_up_proj" or (short == "dense_h_to_4h" and meta.model_type in _GLM)
    if gate_up and rows % 2 == 0:
        return (rows // 2, rows // 2)
    if short not in FUSED_QKV or meta.model_type in _INTERLEAVED_QKV:
        return (rows,)
    q, kv = meta.q_rows, meta.kv_rows
    if q is not None and kv is not None and q + 2 * kv == rows:
        return (q, kv, kv)
    raise ConfigError(
        f"{_SPEC_KEY}: cannot tell how q, k and v are laid out in the fused projection {name!r} "
        f"({rows} rows; the model config gives heads={meta.num_attention_heads}, "
        f"kv_heads={meta.num_kv_heads}, head_dim={meta.head_dim}); add a layer spec for it with "
        '"shape": [[q_rows, k_rows, v_rows], -1]',
        [(_SPEC_KEY, f"no layout known for {name!r}")],
    )
