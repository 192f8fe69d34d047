"""deepshard-kernels' ``fused_weighted_sum`` equals autoep's ``weighted_sum`` reference.

Routes come from the router and `sort_by_expert` as in a MoE layer; the expert rows are random
(plus padding rows). Values and gradients of rows and scores agree in fp32 and with bf16 rows.
"""

from __future__ import annotations

import pytest
import torch

from deepshard.autoep import combine, route, sort_by_expert, weighted_sum
from deepshard.interface.errors import ConfigError

TOKENS, EXPERTS, K, HIDDEN = 40, 8, 2, 16


def _routes(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    routing = route(
        torch.randn(TOKENS, EXPERTS, generator=gen), top_k=K, score_func="softmax",
        route_norm=True, route_scale=1.0,
    )  # fmt: skip
    order = sort_by_expert(routing.expert_ids, EXPERTS)
    rows = torch.randn(TOKENS * K + 3, HIDDEN, generator=gen).to(dtype)
    return rows, routing.weights, order.index


def test_sort_by_expert_is_stable_and_inverts() -> None:
    ids = torch.tensor([[2, 0], [0, 1], [2, 1]])
    order = sort_by_expert(ids, 3)
    assert order.counts.tolist() == [2, 2, 2]
    # Sorted routes: expert 0 (t0, t1), expert 1 (t1, t2), expert 2 (t0, t2).
    assert order.token_of_row.tolist() == [0, 1, 1, 2, 0, 2]
    assert order.index.tolist() == [[4, 0], [1, 2], [5, 3]]
    with pytest.raises(ConfigError, match="num_experts"):
        sort_by_expert(ids, 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_values_and_gradients_agree(dtype: torch.dtype) -> None:
    rows, scores, index = _routes(dtype)
    grad_out = torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(8)).to(dtype)
    results = []
    for impl in ("weighted_sum", "fused_weighted_sum"):
        leaves = rows.clone().requires_grad_(), scores.clone().requires_grad_()
        out = combine(leaves[0], leaves[1], index, impl=impl)  # type: ignore[arg-type]
        out.backward(grad_out)
        results.append((out, leaves[0].grad, leaves[1].grad))
    (ref, ref_rows, ref_scores), (fused, fused_rows, fused_scores) = results
    assert fused.dtype == ref.dtype == dtype
    assert fused_rows is not None and fused_scores is not None
    assert fused_rows.dtype == dtype and fused_scores.dtype == torch.float32
    tol = dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=2**-7, atol=1e-2)
    torch.testing.assert_close(fused, ref, **tol)  # type: ignore[arg-type]
    torch.testing.assert_close(fused_rows, ref_rows, **tol)  # type: ignore[arg-type]
    torch.testing.assert_close(fused_scores, ref_scores, rtol=1e-5, atol=1e-5)


def test_weighted_sum_accumulates_bf16_rows_in_fp32() -> None:
    # 256 equal bf16 rows of 1 + 2^-7 weighted 1/256: an fp32 sum is exact, a bf16 one is not.
    rows = torch.full((256, 1), 1 + 2**-7, dtype=torch.bfloat16)
    weights = torch.full((1, 256), 1 / 256)
    index = torch.arange(256).view(1, 256)
    assert weighted_sum(rows, weights, index).item() == 1 + 2**-7
    assert combine(rows, weights, index, impl="fused_weighted_sum").item() == 1 + 2**-7
