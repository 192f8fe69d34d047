"""Plain-torch stand-ins for model families (no transformers): the module names and shapes of
Mixtral, DeepSeek-V2 (MLA), Bloom and ChatGLM blocks, with a duck-typed ``config``."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from torch import nn

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, VOCAB = 32, 4, 2, 8, 64, 48


def _ns(**children: nn.Module) -> nn.Module:
    module = nn.Module()
    for name, child in children.items():
        module.add_module(name, child)
    return module


def _linear(inputs: int, outputs: int) -> nn.Linear:
    return nn.Linear(inputs, outputs, bias=False)


class Toy(nn.Module):
    """``model.embed_tokens``, ``model.layers[0]`` (the block given), a classifier ``score``
    and an untied ``lm_head``, with a config carrying the head counts."""

    def __init__(self, model_type: str, block: nn.Module, **config: Any) -> None:
        super().__init__()
        defaults = {"num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS,
                    "head_dim": HEAD_DIM, "hidden_size": HIDDEN, "vocab_size": VOCAB}  # fmt: skip
        self.config = SimpleNamespace(model_type=model_type, **{**defaults, **config})
        self.model = _ns(embed_tokens=nn.Embedding(VOCAB, HIDDEN), layers=nn.ModuleList([block]))
        self.score = _linear(HIDDEN, 3)
        self.lm_head = _linear(HIDDEN, VOCAB)


def _llama_attention() -> nn.Module:
    return _ns(
        q_proj=_linear(HIDDEN, HEADS * HEAD_DIM),
        k_proj=_linear(HIDDEN, KV_HEADS * HEAD_DIM),
        v_proj=_linear(HIDDEN, KV_HEADS * HEAD_DIM),
        o_proj=_linear(HEADS * HEAD_DIM, HIDDEN),
    )


def mixtral() -> Toy:
    """Attention, then a sparse MoE with a router ``gate`` and experts ``w1``/``w2``/``w3``."""
    experts = [
        _ns(w1=_linear(HIDDEN, FFN), w2=_linear(FFN, HIDDEN), w3=_linear(HIDDEN, FFN))
        for _ in range(2)
    ]
    moe = _ns(gate=_linear(HIDDEN, 4), experts=nn.ModuleList(experts))
    return Toy("mixtral", _ns(self_attn=_llama_attention(), block_sparse_moe=moe))


def deepseek_v2() -> Toy:
    """Multi-head latent attention: low-rank ``q_a_proj``/``kv_a_proj_with_mqa`` then
    ``q_b_proj``/``kv_b_proj`` up to the heads; an MLP with shared experts."""
    rank = 16
    attention = _ns(
        q_a_proj=_linear(HIDDEN, rank),
        q_b_proj=_linear(rank, KV_HEADS * 2 * HEAD_DIM),
        kv_a_proj_with_mqa=_linear(HIDDEN, rank + HEAD_DIM),
        kv_b_proj=_linear(rank, KV_HEADS * 2 * HEAD_DIM),
        o_proj=_linear(KV_HEADS * HEAD_DIM, HIDDEN),
    )
    shared = _ns(gate_proj=_linear(HIDDEN, FFN), up_proj=_linear(HIDDEN, FFN),
                 down_proj=_linear(FFN, HIDDEN))  # fmt: skip
    mlp = _ns(gate=_linear(HIDDEN, 4), shared_experts=shared)
    return Toy("deepseek_v2", _ns(self_attn=attention, mlp=mlp), num_attention_heads=KV_HEADS)


def bloom() -> Toy:
    """Bloom: a head-interleaved ``query_key_value`` and ``dense`` after attention."""
    attention = _ns(query_key_value=_linear(HIDDEN, 3 * HIDDEN), dense=_linear(HIDDEN, HIDDEN))
    mlp = _ns(dense_h_to_4h=_linear(HIDDEN, FFN), dense_4h_to_h=_linear(FFN, HIDDEN))
    return Toy("bloom", _ns(self_attention=attention, mlp=mlp), num_key_value_heads=HEADS)


def chatglm() -> Toy:
    """GLM: a [Q, K, V] ``query_key_value`` (2 groups) and a fused gate/up ``dense_h_to_4h``."""
    qkv_rows = (HEADS + 2 * KV_HEADS) * HEAD_DIM
    attention = _ns(query_key_value=_linear(HIDDEN, qkv_rows), dense=_linear(HIDDEN, HIDDEN))
    mlp = _ns(dense_h_to_4h=_linear(HIDDEN, 2 * FFN), dense_4h_to_h=_linear(FFN, HIDDEN))
    return Toy("chatglm", _ns(self_attention=attention, mlp=mlp))
