"""The noisy gate policies act while training only, and `MoE.from_config` reads the moe section."""

from __future__ import annotations

import torch
from torch import nn

from deepshard.autoep import MoE
from deepshard.interface.config import DeepShardConfig

HIDDEN = 8


def _layer(**kwargs: object) -> MoE:
    torch.manual_seed(0)
    return MoE(HIDDEN, nn.Linear(HIDDEN, HIDDEN), num_experts=4, drop_tokens=False, **kwargs)  # type: ignore[arg-type]


def test_jitter_perturbs_the_gate_while_training_only() -> None:
    layer = _layer(k=2, noisy_gate_policy="Jitter", top2_2nd_expert_sampling=False)
    x = torch.randn(64, HIDDEN)
    train = [layer.route(x).weights for _ in range(2)]
    assert not torch.equal(train[0], train[1])
    layer.eval()
    evaluated = [layer.route(x).weights for _ in range(2)]
    assert torch.equal(evaluated[0], evaluated[1])
    plain = _layer(k=2, top2_2nd_expert_sampling=False).eval().route(x).weights
    assert torch.equal(evaluated[0], plain)


def test_rsample_and_second_expert_sampling_change_choices_while_training_only() -> None:
    x = torch.randn(256, HIDDEN)
    for k, kwargs in ((1, {"noisy_gate_policy": "RSample"}), (2, {})):
        layer = _layer(k=k, **kwargs).eval()
        greedy = (x @ layer.gate.weight.t()).topk(k).indices
        assert torch.equal(layer.route(x).expert_ids, greedy)
        sampled = layer.train().route(x).expert_ids
        assert not torch.equal(sampled, greedy)
        if k == 2:  # only the second expert is sampled
            assert torch.equal(sampled[:, 0], greedy[:, 0])


def test_from_config_reads_the_moe_section() -> None:
    config = DeepShardConfig.from_dict(
        {"moe": {"num_experts": 8, "top_k": 2, "capacity_factor": 1.5, "min_capacity": 2,
                 "use_rts": False, "drop_tokens": False}}
    )  # fmt: skip
    layer = MoE.from_config(config.moe, HIDDEN, nn.Linear(HIDDEN, HIDDEN))
    assert len(layer.experts) == 8 and layer.config == config.moe
    out, _, counts = layer(torch.randn(5, HIDDEN))
    assert out.shape == (5, HIDDEN) and int(counts.sum()) == 10
