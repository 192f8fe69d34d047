"""Group-limited routing stays inside each token's best groups; route_norm sums to route_scale.

A group's score is the sum of its two best choice scores (``top2_sum``, DeepSeek-V3) or its best
one (``max``, DeepSeek-V2); the best groups are recomputed here in plain Python for each rule.
"""

from __future__ import annotations

import pytest
import torch

from deepshard.autoep import route


def _best_groups(
    choice: torch.Tensor, groups: int, limited: int, rule: str = "top2_sum"
) -> list[set[int]]:
    """Each token's best groups by ``rule`` (two best scores summed, or the best), in Python."""
    per_group = choice.shape[1] // groups
    best = []
    for row in choice.tolist():
        sums = []
        for g in range(groups):
            members = sorted(row[g * per_group : (g + 1) * per_group], reverse=True)
            sums.append(members[0] if rule == "max" else members[0] + members[1])
        order = sorted(range(groups), key=lambda g: sums[g], reverse=True)
        best.append(set(order[:limited]))
    return best


@pytest.mark.parametrize("group_score", ["top2_sum", "max"])
@pytest.mark.parametrize("score_func", ["sigmoid", "softmax"])
def test_group_limited_routing_never_leaves_the_best_groups(
    score_func: str, group_score: str
) -> None:
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(128, 16, generator=gen)
    # A negative bias makes some choice scores negative: masking must still exclude groups.
    bias = torch.randn(16, generator=gen) - 1.0
    routing = route(
        logits, top_k=4, score_func=score_func, correction_bias=bias,  # type: ignore[arg-type]
        route_norm=True, route_scale=1.0, num_groups=4, limited_groups=2,
        group_score=group_score,  # type: ignore[arg-type]
    )  # fmt: skip
    choice = routing.scores + bias
    allowed = _best_groups(choice, 4, 2, group_score)
    other = _best_groups(choice, 4, 2, "max" if group_score == "top2_sum" else "top2_sum")
    assert allowed != other, "the two group rules agree on every token: the test cannot tell"
    unlimited = route(
        logits, top_k=4, score_func=score_func, correction_bias=bias,  # type: ignore[arg-type]
        route_norm=True, route_scale=1.0,
    )  # fmt: skip
    left_out = 0
    for token, ids in enumerate(routing.expert_ids.tolist()):
        assert {expert // 4 for expert in ids} <= allowed[token]
        left_out += not {e // 4 for e in unlimited.expert_ids[token].tolist()} <= allowed[token]
        # Within the allowed groups, the choice is the plain top-4 of the choice scores.
        inside = [e for e in range(16) if e // 4 in allowed[token]]
        expected = sorted(inside, key=lambda e: choice[token, e].item(), reverse=True)[:4]
        assert ids == expected
    assert left_out > 0, "the limit never mattered: the test would pass without masking"


@pytest.mark.parametrize("scale", [1.0, 2.5])
def test_route_norm_makes_weights_sum_to_route_scale(scale: float) -> None:
    logits = torch.randn(32, 8, generator=torch.Generator().manual_seed(3))
    normed = route(logits, top_k=3, score_func="sigmoid", route_norm=True, route_scale=scale)
    sums = normed.weights.sum(-1)
    torch.testing.assert_close(sums, torch.full_like(sums, scale))
    # Without route_norm the weights are the scaled raw scores, which do not sum to the scale.
    raw = route(logits, top_k=3, score_func="sigmoid", route_norm=False, route_scale=scale)
    torch.testing.assert_close(raw.weights, scale * logits.sigmoid().gather(1, raw.expert_ids))
    assert not torch.allclose(raw.weights.sum(-1), sums)
