"""A correction bias changes which experts are chosen, never the weights they get.

DeepSeek-V3's ``e_score_correction_bias`` balances the load without an auxiliary loss: it is
added to the scores for the top-k choice only, and the weights are gathered from the unbiased
sigmoid scores (DeepSpeed 0.19.7's AutoEP dropped this bias entirely, #8369).
"""

from __future__ import annotations

import pytest
import torch

from deepshard.autoep import route
from deepshard.interface.errors import ConfigError


def test_bias_changes_the_choice_but_weights_come_from_unbiased_scores() -> None:
    logits = torch.randn(64, 8, generator=torch.Generator().manual_seed(0))
    # A large bias on experts 6 and 7 makes them every token's choice.
    bias = torch.tensor([0.0, 0, 0, 0, 0, 0, 5.0, 4.0])
    kwargs = dict(top_k=2, score_func="sigmoid", route_norm=False, route_scale=1.0)
    plain = route(logits, **kwargs)
    biased = route(logits, correction_bias=bias, **kwargs)

    assert not torch.equal(plain.expert_ids, biased.expert_ids)
    assert biased.expert_ids.tolist() == [[6, 7]] * 64
    # The weights are the sigmoid of the chosen logits, with no trace of the bias.
    assert torch.equal(biased.weights, logits.sigmoid()[:, 6:8])
    assert torch.equal(biased.scores, plain.scores)
    assert biased.weights.dtype == torch.float32 and biased.expert_ids.dtype == torch.int64


def test_bf16_logits_are_routed_in_fp32() -> None:
    logits = torch.randn(16, 8, generator=torch.Generator().manual_seed(1)).bfloat16()
    routing = route(logits, top_k=2, score_func="softmax", route_norm=False, route_scale=1.0)
    expected = logits.float().softmax(-1).topk(2, dim=-1)
    assert routing.weights.dtype == torch.float32
    assert torch.equal(routing.weights, expected.values)
    assert torch.equal(routing.expert_ids, expected.indices)


@pytest.mark.parametrize(
    ("kwargs", "key"),
    [
        (dict(top_k=9), "expert_parallel.top_k"),
        (dict(top_k=2, correction_bias=torch.zeros(7)), "e_score_correction_bias"),
        (dict(top_k=2, num_groups=3, limited_groups=1), "expert_parallel.num_expert_groups"),
        (dict(top_k=2, num_groups=4, limited_groups=None), "expert_parallel.num_limited_groups"),
        (dict(top_k=3, num_groups=4, limited_groups=1), "expert_parallel.num_limited_groups"),
        (dict(top_k=2, score_func="relu"), "expert_parallel.score_func"),
    ],
)
def test_bad_knobs_name_their_key(kwargs: dict[str, object], key: str) -> None:
    args = dict(score_func="sigmoid", route_norm=True, route_scale=1.0) | kwargs
    with pytest.raises(ConfigError) as caught:
        route(torch.zeros(4, 8), **args)  # type: ignore[arg-type]
    assert caught.value.problems[0][0] == key
