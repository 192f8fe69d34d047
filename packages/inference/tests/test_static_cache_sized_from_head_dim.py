"""The static KV cache takes its head size from ``config.head_dim`` when the config has one.

DeepSpeed sized it with ``hidden_size // num_attention_heads`` always; Qwen3 (hidden 64, 4 heads,
head_dim 32) would get 16-wide keys. Llama without a head_dim falls back to hidden / heads, and a
TP caller's local KV-head count overrides the config's.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import Qwen3Config

from deepshard.inference._cache import StaticKVCache, head_dim_of
from deepshard.interface.errors import ConfigError
from deepshard.testing import import_beside

models = import_beside(__file__, "_batch_models.py")


def test_qwen3_keys_use_the_explicit_head_dim() -> None:
    config = Qwen3Config(
        hidden_size=64, num_attention_heads=4, head_dim=32, num_key_value_heads=2,
        num_hidden_layers=2,
    )  # fmt: skip
    cache = StaticKVCache.for_model(config, batch_size=1, max_len=7, dtype=torch.float32)
    assert len(cache.keys) == len(cache.values) == 2
    assert [tuple(k.shape) for k in cache.keys] == [(1, 2, 7, 32)] * 2
    assert [tuple(v.shape) for v in cache.values] == [(1, 2, 7, 32)] * 2
    assert cache.lengths.tolist() == [0]


def test_llama_without_head_dim_uses_hidden_over_heads() -> None:
    config = SimpleNamespace(
        hidden_size=48, num_attention_heads=6, num_key_value_heads=3, num_hidden_layers=3
    )
    assert head_dim_of(config) == 8
    cache = StaticKVCache.for_model(config, batch_size=2, max_len=5, dtype=torch.float64)
    assert [tuple(k.shape) for k in cache.keys] == [(2, 3, 5, 8)] * 3
    assert cache.keys[0].dtype == torch.float64
    llama = models.tiny_llama().config
    llama.head_dim = None
    assert head_dim_of(llama) == 32 // 4


def test_kv_heads_default_and_tp_override() -> None:
    config = SimpleNamespace(hidden_size=32, num_attention_heads=4, num_hidden_layers=1)
    cache = StaticKVCache.for_model(config, batch_size=1, max_len=3, dtype=torch.float32)
    assert tuple(cache.keys[0].shape) == (1, 4, 3, 8)  # no num_key_value_heads: MHA
    local = StaticKVCache.for_model(
        config, batch_size=1, max_len=3, dtype=torch.float32, kv_heads=1
    )
    assert tuple(local.keys[0].shape) == (1, 1, 3, 8)


def test_bad_sizes_are_refused() -> None:
    with pytest.raises(ConfigError, match="max_len=0"):
        StaticKVCache(
            num_layers=1, batch_size=1, kv_heads=1, max_len=0, head_dim=4, dtype=torch.float32
        )
    with pytest.raises(ConfigError, match="cannot size a KV cache"):
        head_dim_of(SimpleNamespace(num_hidden_layers=1))
