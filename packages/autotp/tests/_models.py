"""Tiny Hugging Face models the plan tests are built from (random weights, built from configs).

transformers is only a test dependency of deepshard-autotp; tests that use these skip with a
reason when it is not importable.
"""

from __future__ import annotations

from typing import Any

import pytest

transformers = pytest.importorskip(
    "transformers",
    reason="the plan tests build tiny Hugging Face models (deepshard-autotp dev group)",
)

SIZES: dict[str, Any] = {
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "tie_word_embeddings": False,
}
"""The issue's tiny Llama: vocab 128, hidden 64, intermediate 128, 2 layers, 8 heads, 2 KV."""


def llama(**overrides: Any) -> Any:
    """A tiny ``LlamaForCausalLM`` (untied unless overridden)."""
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**SIZES, **overrides}))


def qwen3(**overrides: Any) -> Any:
    """A tiny ``Qwen3ForCausalLM`` (per-head q_norm/k_norm of head_dim 16)."""
    config = transformers.Qwen3Config(**{**SIZES, "head_dim": 16, **overrides})
    return transformers.Qwen3ForCausalLM(config)


def phi3(**overrides: Any) -> Any:
    """A tiny ``Phi3ForCausalLM``: fused ``qkv_proj`` (8 q + 2 k + 2 v heads of 8) and
    ``gate_up_proj``."""
    ids = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
    config = transformers.Phi3Config(**{**SIZES, "num_hidden_layers": 1, **ids, **overrides})
    return transformers.Phi3ForCausalLM(config)


def without_tp_plan(model: Any) -> Any:
    """The same model with every Hugging Face tp_plan removed (config, class, instance).

    The class plan is hidden by a subclass made for this model, so the transformers class
    other tests use is left untouched.
    """
    model.config.base_model_tp_plan = None
    model.__class__ = type(f"Planless{type(model).__name__}", (type(model),), {"_tp_plan": None})
    vars(model)["_tp_plan"] = None
    return model
