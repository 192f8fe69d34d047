"""A MoE model's Hugging Face ``tp_plan`` names its experts ``moe_tp_experts``: AutoTP keeps them
(and the router) whole on every rank and splits the rest as the plan says, instead of refusing
the whole plan. (AutoEP spreads the experts; `initialize` applies it before AutoTP.)"""

from __future__ import annotations

import pytest

from deepshard.autotp import Style, make_plan

pytest.importorskip("transformers", reason="transformers is in the dev group only")


def test_mixtral_tp_plan_keeps_experts_and_router_whole() -> None:
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        num_local_experts=4,
    )
    assert config.base_model_tp_plan["layers.*.mlp.experts"] == "moe_tp_experts"
    plan = make_plan(MixtralForCausalLM(config), 2)
    styles = {layer.module: layer.style for layer in plan.layers}
    assert styles["model.layers.0.mlp.experts"] is Style.REPLICATE
    assert "model.layers.0.mlp.gate" not in styles  # the router: no plan entry, left alone
    assert styles["model.layers.0.self_attn.q_proj"] is Style.COLUMN
    assert styles["model.layers.0.self_attn.o_proj"] is Style.ROW
    assert styles["lm_head"] is Style.COLUMN
