"""Hugging Face tp_plan styles, read by duck typing from config, class and instance.

A plain-torch model carries the three plan places Hugging Face uses; the instance's entry
overrides the class's, which overrides the config's.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import ClassVar

import pytest
import torch

from deepshard.autotp import Style, hf_tp_plan, make_plan, split_sizes
from deepshard.interface.errors import ConfigError
from deepshard.testing import import_beside

toys = import_beside(__file__, "_toy_models.py")


class _Planned(toys.Toy):  # type: ignore[misc]
    _tp_plan: ClassVar[dict[str, str]] = {"lm_head": "colwise_rep", "score": "rowwise"}


def _model(instance_plan: dict[str, str]) -> _Planned:
    block = toys.chatglm().model.layers[0]
    model = _Planned("chatglm", block)
    model.config.base_model_tp_plan = {
        "layers.*.self_attention.query_key_value": "local_colwise",
        "layers.*.self_attention.dense": "local_rowwise",
        "layers.*.mlp.dense_h_to_4h": "colwise",
        "layers.*.mlp.dense_4h_to_h": "rowwise",
        "embed_tokens": "embedding_rowwise",
    }
    vars(model)["_tp_plan"] = instance_plan
    return model


def test_styles_map_and_later_places_override_earlier_ones() -> None:
    model = _model({"score": "replicate", "model.layers.*.mlp.dense_h_to_4h": "packed_colwise"})
    assert hf_tp_plan(model)["score"] == "replicate"
    plan = make_plan(model, 2)
    styles = {entry.module: (entry.style, entry.gather_output) for entry in plan.layers}
    assert styles == {
        "model.embed_tokens": (Style.VOCAB, False),
        "model.layers.0.self_attention.query_key_value": (Style.COLUMN, False),
        "model.layers.0.self_attention.dense": (Style.ROW, False),
        "model.layers.0.mlp.dense_h_to_4h": (Style.COLUMN, False),
        "model.layers.0.mlp.dense_4h_to_h": (Style.ROW, False),
        "score": (Style.REPLICATE, False),
        "lm_head": (Style.COLUMN, True),
    }
    packed = plan.layer("model.layers.0.mlp.dense_h_to_4h")
    half = split_sizes(toys.FFN, 2, kv_groups=None)
    assert packed is not None and packed.sizes == (half, half)
    embed = plan.layer("model.embed_tokens")
    assert embed is not None and embed.sizes == (split_sizes(toys.VOCAB, 2, kv_groups=None),)


def test_a_norm_marked_replicated_with_grad_allreduce() -> None:
    model = _model({"model.layers.*.self_attention.dense": "rowwise"})
    model.model.layers[0].self_attention.add_module("q_norm", torch.nn.LayerNorm(8))
    model.config.base_model_tp_plan["layers.*.self_attention.q_norm"] = (
        "replicated_with_grad_allreduce"
    )
    entry = make_plan(model, 2).layer("model.layers.0.self_attention.q_norm")
    assert entry is not None and entry.style is Style.REPLICATE_GRAD_ALLREDUCE


def test_an_unknown_style_names_the_partition_config_key() -> None:
    for style in ("sequence_parallel", "rowwise_rep"):
        model = _model({"model.layers.*.mlp.dense_4h_to_h": style})
        model.config.model_type = "chatglm-like"  # no preset to fall back to
        with pytest.raises(ConfigError, match=style) as caught:
            make_plan(model, 2)
        assert caught.value.problems[0][0] == "tensor_parallel.partition_config"
    assert hf_tp_plan(SimpleNamespace()) == {}  # type: ignore[arg-type]
