"""Plan sources in priority order: explicit specs and presets, then tp_plan, then structure.

The tiny Llama and Qwen3 carry Hugging Face tp_plans; with the plans removed the structural
heuristic must choose the same styles, sizes and gathers; explicit specs override both, the
first matching spec wins with a warning naming the specs that overlap, and ``strict_mode``
refuses Linears no spec matches.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest

from deepshard.autotp import AutoTPWarning, Style, TPPlan, kv_group_split, make_plan
from deepshard.interface.config import TensorParallelConfig
from deepshard.interface.errors import ConfigError
from deepshard.testing import import_beside

models = import_beside(__file__, "_models.py")


def _shape(plan: TPPlan) -> list[tuple[str, Style, Any, bool]]:
    return [(e.module, e.style, e.sizes, e.gather_output) for e in plan.layers]


def _config(**partition: Any) -> TensorParallelConfig:
    return TensorParallelConfig(partition_config=partition)


@pytest.mark.parametrize("build", [models.llama, models.qwen3], ids=["llama", "qwen3"])
@pytest.mark.parametrize("tp_size", [2, 4])
def test_the_heuristic_agrees_with_the_models_tp_plan(build: Any, tp_size: int) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", AutoTPWarning)  # TP 4 > 2 KV heads, checked elsewhere
        from_tp_plan = make_plan(build(), tp_size)
        heuristic = make_plan(models.without_tp_plan(build()), tp_size)
    assert {entry.source for entry in from_tp_plan.layers} == {"tp_plan"}
    assert {entry.source for entry in heuristic.layers} == {"heuristic"}
    assert _shape(heuristic) == _shape(from_tp_plan)
    styles = {entry.module: entry.style for entry in from_tp_plan.layers}
    assert styles["model.layers.1.self_attn.o_proj"] is Style.ROW
    assert styles["model.layers.1.mlp.up_proj"] is Style.COLUMN
    assert styles["model.embed_tokens"] is Style.VOCAB
    head = from_tp_plan.layer("lm_head")
    assert head is not None and head.style is Style.COLUMN and head.gather_output
    # 8 query heads follow their 2 KV groups: the KV-group split of 8 heads of 8 rows.
    q = from_tp_plan.layer("model.layers.0.self_attn.q_proj")
    assert q is not None and q.sizes == (
        kv_group_split(8 * (64 // 8 if build is models.llama else 16), tp_size, 2),
    )


def test_qwen3_head_norms_are_replicated_with_gradient_allreduce() -> None:
    for plan in (
        make_plan(models.qwen3(), 2),
        make_plan(models.without_tp_plan(models.qwen3()), 2),
        make_plan(models.qwen3(), 2, TensorParallelConfig(preset_model="qwen3")),
    ):
        for name in ("model.layers.0.self_attn.q_norm", "model.layers.1.self_attn.k_norm"):
            entry = plan.layer(name)
            assert entry is not None and entry.style is Style.REPLICATE_GRAD_ALLREDUCE
            assert entry.sizes == ()
        assert plan.layer("model.layers.0.input_layernorm") is None


def test_explicit_specs_override_tp_plan_and_heuristic() -> None:
    config = _config(
        layer_specs=[
            {"patterns": [r".*\.mlp\..*"], "partition_type": "skip"},
            {"patterns": [r".*\.self_attn\.o_proj\.weight$"], "partition_type": "row"},
            {"patterns": [r".*\.self_attn\.[qkv]_proj\.weight$"]},
        ]
    )
    for model in (models.llama(), models.without_tp_plan(models.llama())):
        plan = make_plan(model, 2, config)
        up = plan.layer("model.layers.0.mlp.up_proj")
        assert up is not None and up.style is Style.REPLICATE
        assert up.source == "partition_config.layer_specs[0]"
        o_proj = plan.layer("model.layers.1.self_attn.o_proj")
        assert o_proj is not None and o_proj.source == "partition_config.layer_specs[1]"
        # With specs, what no spec matches is left whole: no embedding or LM head split.
        assert plan.layer("lm_head") is None and plan.layer("model.embed_tokens") is None


def test_the_first_matching_spec_wins_and_the_overlap_is_reported() -> None:
    config = _config(
        layer_specs=[
            {"patterns": [r".*\.mlp\.down_proj\.weight$"], "partition_type": "skip"},
            {"patterns": [r".*_proj\.weight$"], "partition_type": "column"},
        ]
    )
    with pytest.warns(AutoTPWarning) as caught:
        plan = make_plan(models.without_tp_plan(models.llama()), 2, config)
    down = plan.layer("model.layers.0.mlp.down_proj")
    assert down is not None and down.style is Style.REPLICATE
    text = " ".join(str(w.message) for w in caught)
    assert "partition_config.layer_specs[0]" in text and "partition_config.layer_specs[1]" in text
    assert "model.layers.0.mlp.down_proj" in text


def test_user_specs_come_before_the_preset_unless_they_replace_it() -> None:
    override = {"patterns": [r".*\.mlp\.up_proj\.weight$"], "partition_type": "skip"}
    merged = TensorParallelConfig(
        preset_model="llama", partition_config={"layer_specs": [override]}
    )
    with pytest.warns(AutoTPWarning, match="preset:llama"):
        plan = make_plan(models.llama(), 2, merged)
    up, gate = plan.layer("model.layers.0.mlp.up_proj"), plan.layer("model.layers.0.mlp.gate_proj")
    assert up is not None and up.style is Style.REPLICATE
    assert gate is not None and gate.style is Style.COLUMN and gate.source == "preset:llama"
    replaced = TensorParallelConfig(
        preset_model="llama",
        partition_config={"layer_specs": [override], "use_default_specs": False},
    )
    only_user = make_plan(models.llama(), 2, replaced)
    assert [entry.module for entry in only_user.layers] == [
        "model.layers.0.mlp.up_proj",
        "model.layers.1.mlp.up_proj",
    ]


def test_model_types_limit_a_spec_to_its_families() -> None:
    spec = {"patterns": [r".*_proj\.weight$"], "partition_type": "skip", "model_types": ["QWEN3"]}
    assert make_plan(models.qwen3(), 2, _config(layer_specs=[spec])).layers
    assert make_plan(models.llama(), 2, _config(layer_specs=[spec])).layers == ()


def test_strict_mode_refuses_unmatched_linears_and_specs_matching_nothing() -> None:
    attention_only = [
        {"patterns": [r".*\.self_attn\.o_proj\.weight$"], "partition_type": "row"},
        {"patterns": [r".*\.self_attn\.[qkv]_proj\.weight$"]},
    ]
    with pytest.raises(ConfigError, match=r"strict_mode") as caught:
        make_plan(models.llama(), 2, _config(layer_specs=attention_only, strict_mode=True))
    assert "model.layers.0.mlp.gate_proj" in str(caught.value)
    typo = [*attention_only, {"patterns": [r".*\.mlp\.(gate|up)_porj\.weight$"]}]
    everything = [*typo, {"patterns": [r".*(mlp|lm_head).*"], "partition_type": "skip"}]
    with pytest.raises(ConfigError) as caught:
        make_plan(models.llama(), 2, _config(layer_specs=everything, strict_mode=True))
    assert caught.value.problems == [
        ("tensor_parallel.partition_config.layer_specs[2]", "matches no module of the model")
    ]
    # Without strict mode the same specs plan, leaving unmatched layers whole.
    assert make_plan(models.llama(), 2, _config(layer_specs=attention_only)).layers
