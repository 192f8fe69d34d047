"""Bad input gets a typed error that names the key to change (and the fix)."""

from __future__ import annotations

from typing import Any

import pytest

from deepshard.autotp import AutoTPWarning, Style, make_plan
from deepshard.interface.config import TensorParallelConfig
from deepshard.interface.errors import ConfigError
from deepshard.testing import import_beside

models = import_beside(__file__, "_models.py")


def _specs(*specs: dict[str, Any], **config: Any) -> TensorParallelConfig:
    return TensorParallelConfig(**config, partition_config={"layer_specs": list(specs)})


def _problem_keys(error: pytest.ExceptionInfo[ConfigError]) -> list[str]:
    return [key for key, _ in error.value.problems]


def test_tp_sizes_that_cannot_work() -> None:
    with pytest.raises(ConfigError, match=r"tensor_parallel\.autotp_size"):
        make_plan(models.llama(), 0)
    with pytest.raises(ConfigError, match=r"tensor_parallel\.autotp_size: the config says 4"):
        make_plan(models.llama(), 2, TensorParallelConfig(autotp_size=4))
    # 128 MLP rows in grains of 64 cannot feed 4 ranks.
    grains = TensorParallelConfig(tp={"tp_grain_size": 64})
    with pytest.raises(ConfigError, match="tp_grain_size") as caught:
        make_plan(models.llama(), 4, grains)
    assert _problem_keys(caught) == ["tensor_parallel.autotp_size"]


def test_a_row_parallel_lm_head_in_training() -> None:
    row_head = _specs({"patterns": [r"lm_head\.weight$"], "partition_type": "row"})
    with pytest.raises(ConfigError, match="row-parallel") as caught:
        make_plan(models.llama(), 2, row_head)
    assert _problem_keys(caught) == ["tensor_parallel.partition_config.layer_specs[0]"]
    head = make_plan(models.llama(), 2, row_head, training=False).layer("lm_head")
    assert head is not None and head.style is Style.ROW


def test_a_tied_lm_head_stays_whole_with_its_embedding() -> None:
    with pytest.warns(AutoTPWarning, match="tied"):
        plan = make_plan(models.llama(tie_word_embeddings=True), 2)
    for name in ("lm_head", "model.embed_tokens"):
        entry = plan.layer(name)
        assert entry is not None and entry.style is Style.REPLICATE and entry.sizes == ()


def test_specs_that_cannot_apply_name_their_key() -> None:
    cases = [
        ({"patterns": [r".*embed_tokens.*"], "partition_type": "row"},
         "layer_specs[0].partition_type"),
        ({"patterns": [r".*input_layernorm.*"]}, "layer_specs[0].partition_type"),
        ({"patterns": [r".*q_proj.*"], "partition_dim": 1}, "layer_specs[0].partition_dim"),
        ({"patterns": [r".*q_proj.*"], "shape": [[30, 30], -1]}, "layer_specs[0].shape"),
        ({"patterns": [r".*q_proj.*"], "shape": [3, -1]}, "layer_specs[0].shape"),
        ({"patterns": [r".*down_proj.*"], "partition_type": "row", "gather_output": True},
         "layer_specs[0].gather_output"),
        ({"patterns": ["(unclosed"]}, "layer_specs[0].patterns"),
    ]  # fmt: skip
    for spec, key in cases:
        with pytest.raises(ConfigError) as caught:
            make_plan(models.llama(), 2, _specs(spec))
        assert _problem_keys(caught) == [f"tensor_parallel.partition_config.{key}"], spec


def test_shapes_and_presets_checked_by_the_config() -> None:
    with pytest.raises(ConfigError, match=r"shape.*split dimension 0"):
        _specs({"patterns": ["x"], "shape": [-1, [4, 4]]})
    with pytest.raises(ConfigError, match=r"shape.*dimension 1 is 0"):
        _specs({"patterns": ["x"], "shape": [2, 0]})
    with pytest.raises(ConfigError, match=r"tensor_parallel\.preset_model.*llama"):
        make_plan(models.llama(), 2, TensorParallelConfig(preset_model="lama"))


def test_a_tp_plan_style_autotp_cannot_honour_refuses_the_whole_plan() -> None:
    """Phi-3's plan gathers qkv and splits o_proj's whole input ("rowwise_split_input"): with
    no preset for the model's type the plan is refused whole; Phi-3's own type has one, which
    plans it instead, with a warning naming the refusal and the key."""
    other = models.phi3()
    other.config.model_type = "phi3-custom"
    with pytest.raises(ConfigError, match="rowwise_split_input") as caught:
        make_plan(other, 2)
    assert _problem_keys(caught) == ["tensor_parallel.partition_config"]
    with pytest.warns(AutoTPWarning, match=r"rowwise_split_input.*'phi3' preset instead"):
        fallback = make_plan(models.phi3(), 2)
    explicit = make_plan(models.phi3(), 2, TensorParallelConfig(preset_model="phi3"))
    assert fallback.layers == explicit.layers
