"""`AutoTPMeta` is read from each model's own config, so two models never share sizes.

Configs are probed by duck typing: the Hugging Face names, GLM's ``multi_query_group_num`` /
``kv_channels`` / ``ffn_hidden_size`` / ``padded_vocab_size``, GPT-2's ``n_head`` /
``n_embd``, and a multimodal config's ``text_config``.
"""

from __future__ import annotations

import warnings
from types import SimpleNamespace

import pytest

from deepshard.autotp import AutoTPMeta, AutoTPWarning, kv_group_split, make_plan
from deepshard.interface.errors import ConfigError
from deepshard.testing import import_beside

models = import_beside(__file__, "_models.py")


def test_a_llama_config_gives_every_field() -> None:
    meta = AutoTPMeta.from_model_config(models.llama().config, tp_grain_size=8)
    assert meta == AutoTPMeta(
        num_attention_heads=8, num_kv_heads=2, head_dim=64 // 8, hidden_size=64,
        intermediate_size=128, vocab_size=128, model_type="llama", tp_grain_size=8,
    )  # fmt: skip
    assert (meta.q_rows, meta.kv_rows) == (8 * 8, 2 * 8)


def test_other_families_spellings_and_text_config() -> None:
    glm = SimpleNamespace(model_type="chatglm", num_attention_heads=32, multi_query_group_num=2,
                          kv_channels=128, hidden_size=4096, ffn_hidden_size=13696,
                          padded_vocab_size=65024)  # fmt: skip
    meta = AutoTPMeta.from_model_config(glm)
    assert (meta.num_kv_heads, meta.head_dim, meta.intermediate_size, meta.vocab_size) == (
        2, 128, 13696, 65024,
    )  # fmt: skip
    gpt2 = AutoTPMeta.from_model_config(SimpleNamespace(n_head=12, n_embd=768, n_inner=None))
    assert (gpt2.num_attention_heads, gpt2.num_kv_heads, gpt2.head_dim) == (12, 12, 64)
    vlm = SimpleNamespace(model_type="qwen3_vl", num_heads=16,
                          text_config=SimpleNamespace(num_attention_heads=8, num_key_value_heads=4,
                                                      head_dim=32))  # fmt: skip
    text = AutoTPMeta.from_model_config(vlm)
    assert (text.num_attention_heads, text.num_kv_heads, text.head_dim) == (8, 4, 32)
    assert text.model_type == "qwen3_vl"
    assert AutoTPMeta.from_model_config(None) == AutoTPMeta()


def test_two_models_with_different_head_counts_plan_independently() -> None:
    first = models.llama()
    before = make_plan(first, 2)
    # A second model with 4 KV heads of 16 (4 query heads) planned in between.
    second = models.llama(num_attention_heads=4, num_key_value_heads=4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", AutoTPWarning)
        make_plan(second, 4)
    other = make_plan(second, 2)
    assert make_plan(first, 2) == before
    assert AutoTPMeta.from_model_config(first.config).num_kv_heads == 2
    k_first, k_second = (
        before.layer("model.layers.0.self_attn.k_proj"),
        other.layer("model.layers.0.self_attn.k_proj"),
    )
    assert k_first is not None and k_first.sizes == (kv_group_split(2 * 8, 2, 2),)
    assert k_second is not None and k_second.sizes == (kv_group_split(4 * 16, 2, 4),)


def test_inconsistent_head_counts_and_grains_are_refused() -> None:
    with pytest.raises(ConfigError, match="multiple of the key/value heads"):
        AutoTPMeta.from_model_config(SimpleNamespace(num_attention_heads=6, num_key_value_heads=4))
    with pytest.raises(ConfigError, match=r"tensor_parallel\.tp\.tp_grain_size"):
        AutoTPMeta.from_model_config(None, tp_grain_size=0)
