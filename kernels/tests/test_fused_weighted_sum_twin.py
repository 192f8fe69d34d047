"""`fused_weighted_sum`: the op equals its twin and a per-token loop, forward and backward.

The rows are built the way a MoE layer builds them: each token's K choices are sorted by
expert (stable), so ``index`` is the inverse of that sort, plus padding rows nobody reads.
"""

from __future__ import annotations

import re

import pytest
import torch

from deepshard.kernels import fused_weighted_sum, reference_fused_weighted_sum

TOKENS, K, HIDDEN, EXPERTS, PADDING = 12, 3, 8, 5, 4


def _case(dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    experts = torch.randint(0, EXPERTS, (TOKENS * K,), generator=gen)
    order = experts.argsort(stable=True)
    index = torch.empty_like(order)
    index[order] = torch.arange(TOKENS * K)
    rows = torch.randn(TOKENS * K + PADDING, HIDDEN, generator=gen).to(dtype)
    scores = torch.rand(TOKENS, K, generator=gen)
    return rows, scores, index.view(TOKENS, K)


def _loop(rows: torch.Tensor, scores: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """One token at a time, one choice at a time, in fp64: the definition of the op."""
    out = []
    for t in range(index.shape[0]):
        acc = torch.zeros(rows.shape[1], dtype=torch.float64)
        for k in range(index.shape[1]):
            acc = acc + scores[t, k].double() * rows[index[t, k]].double()
        out.append(acc)
    return torch.stack(out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forward_equals_the_twin_and_the_loop(dtype: torch.dtype) -> None:
    rows, scores, index = _case(dtype)
    fused = fused_weighted_sum(rows, scores, index)
    twin = reference_fused_weighted_sum(rows, scores, index)
    assert fused.dtype == dtype and fused.shape == (TOKENS, HIDDEN)
    assert torch.equal(fused, twin)
    # fp32 accumulation: a bf16 result is the exact sum rounded about once (not K roundings),
    # so within one bf16 rounding (2^-8 relative) of the fp64 definition.
    exact = _loop(rows, scores, index)
    rtol = 1e-6 if dtype == torch.float32 else 2**-8
    torch.testing.assert_close(fused.double(), exact, rtol=rtol, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gradients_of_rows_and_scores_equal_autograd_of_the_loop(dtype: torch.dtype) -> None:
    rows, scores, index = _case(dtype, seed=1)
    # Representable in the rows' dtype: the output's gradient arrives in that dtype.
    grad_out = torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(2))
    grad_out = grad_out.to(dtype).float()
    leaves = [rows.clone().requires_grad_(), scores.clone().requires_grad_()]
    (fused_weighted_sum(leaves[0], leaves[1], index).float() * grad_out).sum().backward()
    ref = [rows.double().requires_grad_(), scores.double().requires_grad_()]
    (_loop(ref[0], ref[1], index) * grad_out.double()).sum().backward()
    assert leaves[0].grad is not None and leaves[1].grad is not None
    assert leaves[0].grad.dtype == dtype and leaves[1].grad.dtype == torch.float32
    assert torch.count_nonzero(leaves[0].grad[-PADDING:]) == 0  # padding rows: zero gradient
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2**-7, atol=1e-3)
    torch.testing.assert_close(leaves[0].grad.double(), ref[0].grad, **tol)  # type: ignore[arg-type]
    torch.testing.assert_close(leaves[1].grad.double(), ref[1].grad, **tol)  # type: ignore[arg-type]


def test_opcheck_forward_and_backward() -> None:
    rows, scores, index = _case(torch.float32, seed=3)
    op = torch.ops.deepshard.fused_weighted_sum.default
    torch.library.opcheck(op, (rows.requires_grad_(), scores.requires_grad_(), index))
    grad_out = torch.randn(TOKENS, HIDDEN)
    backward = torch.ops.deepshard.fused_weighted_sum_backward.default
    torch.library.opcheck(backward, (grad_out, rows.detach(), scores.detach(), index))


def test_traces_under_torch_compile() -> None:
    rows, scores, index = _case(torch.float32, seed=4)
    compiled = torch.compile(fused_weighted_sum, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(
        compiled(rows, scores, index), fused_weighted_sum(rows, scores, index)
    )


@pytest.mark.parametrize(
    ("change", "error", "words"),
    [
        (lambda r, s, i: (r, s, i + 100), ValueError, "index values must be in [0, 40)"),
        (lambda r, s, i: (r, s[:, :2], i), ValueError, "scores and index must both be [T, K]"),
        (lambda r, s, i: (r[0], s, i), ValueError, "rows must be [N >= 1, H]"),
        (lambda r, s, i: (r.long(), s, i), TypeError, "rows must be fp32, bf16 or fp16"),
        (lambda r, s, i: (r, s, i.float()), TypeError, "index must be int64 or int32"),
    ],
)
def test_bad_arguments_say_what_is_wrong(change, error, words) -> None:  # type: ignore[no-untyped-def]
    rows, scores, index = change(*_case(torch.float32))
    with pytest.raises(error, match=re.escape(words)):
        fused_weighted_sum(rows, scores, index)
