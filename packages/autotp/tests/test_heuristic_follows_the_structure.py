"""The structural heuristic on Mixtral, DeepSeek-V2 (MLA), Bloom and ChatGLM blocks, and the
presets of the same families, which must choose the same styles and sizes for every Linear.

Routers and the low-rank MLA projections stay whole, the Linear feeding the residual add is
row-parallel, a classifier with no row partner is left alone, fused layouts follow the
architecture (Bloom's head-interleaved QKV is one sub-parameter, GLM's is q, k, v).
"""

from __future__ import annotations

from typing import Any

import pytest
from torch import nn

from deepshard.autotp import Style, TPPlan, kv_group_split, make_plan, split_sizes
from deepshard.interface.config import TensorParallelConfig
from deepshard.testing import import_beside

toys = import_beside(__file__, "_toy_models.py")

COLUMN, ROW, WHOLE = Style.COLUMN, Style.ROW, Style.REPLICATE


def _styles(plan: TPPlan) -> dict[str, Style]:
    return {entry.module: entry.style for entry in plan.layers}


def _linears(model: nn.Module, plan: TPPlan) -> list[tuple[str, Any]]:
    kept = {name for name, module in model.named_modules() if isinstance(module, nn.Linear)}
    return [
        (e.module, (e.style, e.sizes, e.gather_output)) for e in plan.layers if e.module in kept
    ]


EXPECTED = {
    "mixtral": {
        "self_attn.q_proj": COLUMN, "self_attn.o_proj": ROW, "block_sparse_moe.gate": WHOLE,
        "block_sparse_moe.experts.0.w1": COLUMN, "block_sparse_moe.experts.1.w2": ROW,
        "block_sparse_moe.experts.1.w3": COLUMN,
    },
    "deepseek_v2": {
        "self_attn.q_a_proj": WHOLE, "self_attn.kv_a_proj_with_mqa": WHOLE,
        "self_attn.q_b_proj": COLUMN, "self_attn.kv_b_proj": COLUMN, "self_attn.o_proj": ROW,
        "mlp.gate": WHOLE, "mlp.shared_experts.up_proj": COLUMN,
        "mlp.shared_experts.down_proj": ROW,
    },
    "bloom": {
        "self_attention.query_key_value": COLUMN, "self_attention.dense": ROW,
        "mlp.dense_h_to_4h": COLUMN, "mlp.dense_4h_to_h": ROW,
    },
    "chatglm": {
        "self_attention.query_key_value": COLUMN, "self_attention.dense": ROW,
        "mlp.dense_h_to_4h": COLUMN, "mlp.dense_4h_to_h": ROW,
    },
}  # fmt: skip


@pytest.mark.parametrize("family", sorted(EXPECTED))
def test_heuristic_styles_and_the_familys_preset_agree(family: str) -> None:
    heuristic = make_plan(getattr(toys, family)(), 2)
    styles = _styles(heuristic)
    for suffix, style in EXPECTED[family].items():
        assert styles[f"model.layers.0.{suffix}"] is style, suffix
    assert "score" not in styles  # a classifier with no row partner stays whole
    head = heuristic.layer("lm_head")
    assert head is not None and head.style is COLUMN and head.gather_output
    assert styles["model.embed_tokens"] is Style.VOCAB
    model = getattr(toys, family)()
    preset = make_plan(model, 2, TensorParallelConfig(preset_model=family))
    assert {entry.source for entry in preset.layers} == {f"preset:{family}"}
    assert _linears(model, preset) == _linears(model, heuristic)


def test_fused_qkv_layouts_follow_the_architecture() -> None:
    hidden, heads, kv, head_dim = toys.HIDDEN, toys.HEADS, toys.KV_HEADS, toys.HEAD_DIM
    bloom = make_plan(toys.bloom(), 2).layer("model.layers.0.self_attention.query_key_value")
    # Head by head [q0 k0 v0 q1 ...]: one sub-parameter of `heads` groups (KV heads == heads).
    assert bloom is not None and bloom.sizes == (kv_group_split(3 * hidden, 2, heads),)
    glm = make_plan(toys.chatglm(), 2)
    qkv = glm.layer("model.layers.0.self_attention.query_key_value")
    assert qkv is not None
    assert qkv.sizes == tuple(
        kv_group_split(rows, 2, kv) for rows in (heads * head_dim, kv * head_dim, kv * head_dim)
    )
    gate_up = glm.layer("model.layers.0.mlp.dense_h_to_4h")
    half = split_sizes(toys.FFN, 2, kv_groups=None)
    assert gate_up is not None and gate_up.sizes == (half, half)
