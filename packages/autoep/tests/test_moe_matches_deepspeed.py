"""`MoE` gives DeepSpeed 0.19.7's ``deepspeed.moe.layer.MoE`` forward on the same weights.

Only where DeepSpeed is importable (the workspace's ``bench`` group). The cases avoid
DeepSpeed's randomness: no random token selection where drops happen (top-1 runs without
drops), and no second-expert sampling; dropping is then deterministic in both (top-2 by
position, top-k by gate).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from deepshard.autoep import MoE

layer_module = pytest.importorskip("deepspeed.moe.layer", reason="DeepSpeed is in the bench group")

HIDDEN = 16

CASES = [
    dict(k=1, capacity_factor=4.0, eval_capacity_factor=4.0),
    dict(k=1, drop_tokens=False),
    dict(k=2, capacity_factor=0.5, min_capacity=0),
    dict(k=2, drop_tokens=False),
    dict(k=3, capacity_factor=0.5, min_capacity=0),
    dict(k=2, capacity_factor=1.0, use_residual=True),
]


def _our_state(ds: nn.Module) -> dict[str, torch.Tensor]:
    """DeepSpeed's parameter names mapped onto this layer's."""
    renames = {
        "deepspeed_moe.gate.wg.": "gate.",
        "deepspeed_moe.experts.deepspeed_experts.": "experts.",
    }
    state = {}
    for name, tensor in ds.state_dict().items():
        for old, new in renames.items():
            name = name.replace(old, new)
        state[name] = tensor
    return state


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
@pytest.mark.parametrize("training", [True, False])
def test_forward_equals_deepspeed(case: dict[str, Any], training: bool) -> None:
    torch.manual_seed(0)
    expert = nn.Sequential(nn.Linear(HIDDEN, 32), nn.GELU(), nn.Linear(32, HIDDEN))
    common: dict[str, Any] = dict(num_experts=4, use_rts=False, top2_2nd_expert_sampling=False)
    ds = layer_module.MoE(HIDDEN, expert, **common, **case).train(training)
    ours = MoE(HIDDEN, expert, **common, **case).train(training)
    ours.load_state_dict(_our_state(ds))
    x = torch.randn(2, 24, HIDDEN)
    ds_out, ds_l_aux, ds_counts = ds(x)
    out, l_aux, counts = ours(x)
    torch.testing.assert_close(out, ds_out, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(l_aux, ds_l_aux.float(), rtol=1e-6, atol=1e-7)
    assert counts.tolist() == ds_counts.tolist()
    # The gate's gradient agrees too (through the combine weights and the auxiliary loss).
    (ds_out.square().sum() + ds_l_aux).backward()
    (out.square().sum() + l_aux).backward()
    ds_grad = ds.deepspeed_moe.gate.wg.weight.grad
    torch.testing.assert_close(ours.gate.weight.grad, ds_grad, rtol=1e-4, atol=1e-6)
