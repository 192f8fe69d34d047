"""`route` equals the Hugging Face gates of Mixtral, Qwen3-MoE and DeepSeek-V2/V3 on random inputs.

Each HF router computes its own logits from hidden states; `route` receives those logits (the
fp32 product for DeepSeek, as its gate computes it) and must choose the same experts with the
same weights. DeepSeek's gate returns its top-k unsorted, so both sides are compared sorted by
expert id.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from deepshard.autoep import Routing, route

transformers = pytest.importorskip("transformers", reason="transformers is in the dev group only")


def _by_expert(weights: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    ids, order = ids.sort(dim=-1)
    return weights.gather(-1, order), ids


def _assert_same(ours: Routing, hf_weights: torch.Tensor, hf_ids: torch.Tensor) -> None:
    weights, ids = _by_expert(ours.weights, ours.expert_ids)
    expected_weights, expected_ids = _by_expert(hf_weights.float(), hf_ids)
    assert torch.equal(ids, expected_ids)
    torch.testing.assert_close(weights, expected_weights, rtol=1e-6, atol=1e-7)


def _randomised(router: torch.nn.Module, seed: int) -> torch.nn.Module:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=gen))
    return router


def _hidden(seed: int) -> torch.Tensor:
    return torch.randn(96, 32, generator=torch.Generator().manual_seed(seed))


def test_mixtral_gate() -> None:
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter

    config = transformers.MixtralConfig(hidden_size=32, num_local_experts=8, num_experts_per_tok=2)
    gate = _randomised(MixtralTopKRouter(config), 10)
    hidden = _hidden(11)
    logits, weights, ids = gate(hidden)
    ours = route(logits, top_k=2, score_func="softmax", route_norm=True, route_scale=1.0)
    _assert_same(ours, weights, ids)


@pytest.mark.parametrize("norm", [True, False])
def test_qwen3_moe_gate(norm: bool) -> None:
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    config = transformers.Qwen3MoeConfig(
        hidden_size=32, num_experts=16, num_experts_per_tok=4, norm_topk_prob=norm
    )
    gate = _randomised(Qwen3MoeTopKRouter(config), 12)
    logits, weights, ids = gate(_hidden(13))
    ours = route(logits, top_k=4, score_func="softmax", route_norm=norm, route_scale=1.0)
    _assert_same(ours, weights, ids)


@pytest.mark.parametrize(("groups", "limited"), [(4, 2), (2, 1), (1, 1)])
def test_deepseek_v3_gate(groups: int, limited: int) -> None:
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    settings: dict[str, Any] = dict(
        hidden_size=32, n_routed_experts=16, num_experts_per_tok=4, n_group=groups,
        topk_group=limited, norm_topk_prob=True, routed_scaling_factor=2.5,
    )  # fmt: skip
    gate = _randomised(DeepseekV3TopkRouter(transformers.DeepseekV3Config(**settings)), 14)
    bias = 0.5 * torch.randn(16, generator=torch.Generator().manual_seed(15))
    gate.e_score_correction_bias.copy_(bias)
    logits, weights, ids = gate(_hidden(16))
    ours = route(
        logits, top_k=4, score_func="sigmoid", correction_bias=bias, route_norm=True,
        route_scale=2.5, num_groups=groups, limited_groups=limited,
    )  # fmt: skip
    _assert_same(ours, weights, ids)
    # The bias mattered: without it some token would choose differently.
    unbiased = route(logits, top_k=4, score_func="sigmoid", route_norm=True, route_scale=2.5,
                     num_groups=groups, limited_groups=limited)  # fmt: skip
    assert not torch.equal(unbiased.expert_ids.sort(-1).values, ids.sort(-1).values)
    assert torch.equal(logits, F.linear(_hidden(16), gate.weight))


@pytest.mark.parametrize("method", ["group_limited_greedy", "greedy"])
def test_deepseek_v2_gate(method: str) -> None:
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter

    from deepshard.autoep import PRESETS
    from deepshard.autoep._presets import router_settings
    from deepshard.interface.config.moe import ExpertParallelConfig

    settings: dict[str, Any] = dict(
        hidden_size=32, n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2,
        topk_method=method, routed_scaling_factor=1.5,
    )  # fmt: skip
    gate = _randomised(DeepseekV2TopkRouter(transformers.DeepseekV2Config(**settings)), 17)
    logits, weights, ids = gate(_hidden(18))
    # The knobs come from the gate module, as parallelize_experts reads them.
    knobs = router_settings(gate, PRESETS["deepseek_v2"], ExpertParallelConfig())
    assert (knobs.num_groups, knobs.group_score) == ((4, "max") if method != "greedy" else
                                                     (None, "max"))  # fmt: skip
    ours = route(
        logits, top_k=knobs.top_k, score_func=knobs.score_func, route_norm=knobs.route_norm,
        route_scale=knobs.route_scale, num_groups=knobs.num_groups,
        limited_groups=knobs.limited_groups, group_score=knobs.group_score,
    )  # fmt: skip
    _assert_same(ours, weights, ids)
    if method == "greedy":
        return
    # Both the group limit and V2's max rule changed some token's choice (V3's rule differs).
    for other in (
        route(logits, top_k=4, score_func="softmax", route_norm=False, route_scale=1.5),
        route(logits, top_k=4, score_func="softmax", route_norm=False, route_scale=1.5,
              num_groups=4, limited_groups=2, group_score="top2_sum"),
    ):  # fmt: skip
        assert not torch.equal(other.expert_ids.sort(-1).values, ids.sort(-1).values)
