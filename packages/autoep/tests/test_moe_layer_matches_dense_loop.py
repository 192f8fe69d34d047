"""`MoE` computes what its gate decided: a per-token loop over the chosen experts agrees.

The loop runs each token through each of its kept experts one at a time and adds the outputs
with the gate's weights, the definition of the layer; both combine implementations, top-1/2/3,
dropping and not, the residual mix, gradients, and the refusals are covered.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from deepshard.autoep import MoE
from deepshard.interface.errors import ConfigError

HIDDEN = 16


def _expert() -> nn.Module:
    return nn.Sequential(nn.Linear(HIDDEN, 32), nn.GELU(), nn.Linear(32, HIDDEN))


def _loop(layer: MoE, x: torch.Tensor) -> torch.Tensor:
    tokens = x.reshape(-1, HIDDEN)
    gating = layer.route(tokens)
    out = torch.zeros_like(tokens)
    for t in range(tokens.shape[0]):
        for j, expert in enumerate(gating.expert_ids[t].tolist()):
            if gating.kept[t, j]:
                out[t] += gating.weights[t, j] * layer.experts[expert](tokens[t : t + 1])[0]
    return out.view(x.shape)


@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("drop_tokens", [True, False])
@pytest.mark.parametrize("impl", ["weighted_sum", "fused_weighted_sum"])
def test_layer_equals_the_loop(k: int, drop_tokens: bool, impl: str) -> None:
    torch.manual_seed(k)
    layer = MoE(
        HIDDEN, _expert(), num_experts=4, k=k, capacity_factor=0.5, min_capacity=0,
        drop_tokens=drop_tokens, use_rts=False, combine_impl=impl,  # type: ignore[arg-type]
    ).eval()  # fmt: skip
    x = torch.randn(2, 12, HIDDEN)
    out, l_aux, exp_counts = layer(x)
    torch.testing.assert_close(out, _loop(layer, x), rtol=1e-5, atol=1e-6)
    assert int(exp_counts.sum()) == 24 * k and l_aux.dim() == 0
    dropped = not bool(layer.route(x.reshape(-1, HIDDEN)).kept.all())
    assert dropped == drop_tokens  # capacity 0.5 drops, unless drop_tokens is off


def test_dropped_top1_tokens_output_zero_and_gradients_reach_every_parameter() -> None:
    torch.manual_seed(0)
    layer = MoE(HIDDEN, _expert(), num_experts=2, k=1, capacity_factor=0.25, min_capacity=0,
                use_rts=False)  # fmt: skip
    x = torch.randn(16, HIDDEN, requires_grad=True)
    out, l_aux, _ = layer(x)
    kept = layer.route(x).kept.squeeze(1)
    assert not bool(kept.all()) and bool(kept.any())
    assert torch.count_nonzero(out[~kept]) == 0
    (out.square().sum() + l_aux).backward()
    assert layer.gate.weight.grad is not None and layer.gate.weight.grad.abs().sum() > 0
    for expert in layer.experts:
        assert all(p.grad is not None for p in expert.parameters())


def test_residual_mixes_the_dense_expert_with_a_softmax_coefficient() -> None:
    torch.manual_seed(1)
    expert = _expert()
    layer = MoE(HIDDEN, expert, num_experts=4, k=2, use_residual=True, drop_tokens=False).eval()
    x = torch.randn(10, HIDDEN)
    out, _, _ = layer(x)
    assert layer.mlp is expert and layer.coefficient is not None
    mix = F.softmax(layer.coefficient(x), dim=-1)
    expected = _loop(layer, x) * mix[:, :1] + expert(x) * mix[:, 1:]
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        (dict(num_experts=4, ep_size=2), "moe.ep_size"),
        (dict(num_experts=3, ep_size=2), "num_experts"),
        (dict(num_experts=4, capacity_factor=0.0), "capacity_factor"),
        (dict(num_experts=4, noisy_gate_policy="Gaussian"), "noisy_gate_policy"),
        (dict(num_experts=4, combine_impl="legacy_bmm"), "combine_impl"),
        (dict(num_experts=2, k=3), "moe.top_k"),
    ],
)
def test_bad_arguments_are_config_errors(kwargs: dict[str, object], words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        MoE(HIDDEN, _expert(), **kwargs)  # type: ignore[arg-type]
