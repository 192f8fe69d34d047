"""``score_apply: "pre"`` scales each token's expert INPUT by its routing weight, on 2 EP ranks.

Each rank replaces a tiny DeepSeek-V2 model's MoE block (8 experts, top-2, group-limited, one
shared expert) with ``score_apply="pre"`` and runs its own random tokens through it. The
reference, computed here in the parent process from the unreplaced block, is a dense loop:
Hugging Face's own gate picks the experts and weights, and every chosen expert's gated MLP is
applied to ``weight * x`` and the results summed unweighted, plus the shared expert. Values and
gradients (input, router, shared expert, and this rank's expert slices, which see both ranks'
tokens and are scaled by the block's documented ``grad_scale``) must agree. The post-weighted
loop must differ, so a layer that ignored ``pre`` would fail.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from deepshard.autoep import ExpertParallelBlock, parallelize_experts
from deepshard.comm import ParallelDims
from deepshard.interface import Topology
from deepshard.interface.config.moe import ExpertParallelConfig
from deepshard.testing import import_beside, run_on_mesh

# multi-rank, and each rank imports transformers' modeling code
pytestmark = pytest.mark.slow

pytest.importorskip("transformers", reason="transformers is in the dev group only")
_tiny = import_beside(__file__, "_tiny_moe.py")

EXPERTS, WORLD, BLOCK = 8, 2, "model.layers.1.mlp"


def _tokens(rank: int) -> torch.Tensor:
    return torch.randn(2, 6, 64, generator=torch.Generator().manual_seed(100 + rank))


def _probe() -> torch.Tensor:
    return torch.randn(2, 6, 64, generator=torch.Generator().manual_seed(7))


def _rank(mesh: Any) -> dict[str, Any]:
    dims = ParallelDims.from_mesh(mesh)
    model = _tiny.build("deepseek_v2", EXPERTS)
    config = ExpertParallelConfig(enabled=True, autoep_size=WORLD, score_apply="pre")
    report = parallelize_experts(model, dims, config)
    block = model.get_submodule(BLOCK)
    assert isinstance(block, ExpertParallelBlock) and block.score_apply == "pre"
    x = _tokens(dims.rank).requires_grad_(True)
    out = block(x)
    (out * _probe()).sum().backward()
    grads = {n: p.grad for n, p in block.named_parameters() if p.grad is not None}
    return {
        "out": out.detach(),
        "x_grad": x.grad,
        "grads": grads,
        "range": report.blocks[0].local_experts,
        "grad_scale": block.local_experts.grad_scale,
    }


def _loop(block: Any, x: torch.Tensor, *, pre: bool) -> torch.Tensor:
    """The definition: HF's gate routes; the weight scales the expert input (or its output)."""
    tokens = x.reshape(-1, x.shape[-1])
    _, weights, ids = block.gate(tokens)
    experts, rows = block.experts, []
    for t in range(tokens.shape[0]):
        total = torch.zeros_like(tokens[t])
        for j, e in enumerate(ids[t].tolist()):
            w = weights[t, j]
            inp = w * tokens[t] if pre else tokens[t]
            gate, up = F.linear(inp, experts.gate_up_proj[e]).chunk(2, dim=-1)
            y = F.linear(experts.act_fn(gate) * up, experts.down_proj[e])
            total = total + (y if pre else w * y)
        rows.append(total)
    return (torch.stack(rows) + block.shared_experts(tokens)).view(x.shape)


def test_pre_scales_expert_inputs_values_and_gradients(tmp_path: Path) -> None:
    results = run_on_mesh(
        _rank, WORLD, topology=Topology(ep=WORLD), store_dir=tmp_path, timeout_s=300
    )
    ref = _tiny.build("deepseek_v2", EXPERTS).get_submodule(BLOCK)
    expert_grads: dict[str, torch.Tensor] = {}
    for rank, res in enumerate(results):
        block = copy.deepcopy(ref)
        x = _tokens(rank).requires_grad_(True)
        expected = _loop(block, x, pre=True)
        torch.testing.assert_close(res["out"], expected.detach(), rtol=1e-5, atol=1e-5)
        post = _loop(block, x, pre=False).detach()
        assert (post - expected.detach()).abs().max() > 1e-3, "pre and post agree: no test"
        (expected * _probe()).sum().backward()
        torch.testing.assert_close(res["x_grad"], x.grad, rtol=1e-5, atol=1e-5)
        for name, param in block.named_parameters():
            if name.startswith("experts."):
                expert_grads[name] = expert_grads.get(name, 0) + param.grad  # type: ignore[operator]
            else:
                assert param.grad is not None and param.grad.abs().sum() > 0, name
                torch.testing.assert_close(res["grads"][name], param.grad, rtol=1e-5, atol=1e-5)
    # Expert slices process both ranks' tokens: the sum of both references' gradients.
    for res in results:
        lo, hi = res["range"]
        assert hi - lo == EXPERTS // WORLD
        for name, full in expert_grads.items():
            expected_grad = res["grad_scale"] * full[lo:hi]
            torch.testing.assert_close(res["grads"][name], expected_grad, rtol=1e-5, atol=1e-5)
