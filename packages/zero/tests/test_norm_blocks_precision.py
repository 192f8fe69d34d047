"""The gradient norm in fp32 blocks with an fp64 sum stays within 5e-8 of the fp64 norm, whatever
the length, and fp32 overflow of finite values is not mistaken for a gradient overflow.

The tensors span several `NORM_CHUNK`s with ragged tails, so every code path of the blocking
(whole blocks, a short block, several chunks) contributes. The reference is the norm of every
element in fp64. Bound: 5e-8 relative. One 1024-element fp32 block reduction can be off by at
most ~6e-5 relative in theory; on these data the blocked norm is off by 1e-11 .. 8e-9
(measured), one fp32 reduction over the whole 2.1M-element tensor by 3e-7 .. 2e-4.
"""

from __future__ import annotations

import math

import pytest
import torch

from deepshard.zero import global_grad_norm, grad_overflow
from deepshard.zero.norms import NORM_BLOCK, NORM_CHUNK

LENGTH = 2 * NORM_CHUNK + 3 * NORM_BLOCK + 17


def _data(kind: str) -> torch.Tensor:
    gen = torch.Generator().manual_seed(7)
    if kind == "gaussian":
        return torch.randn(LENGTH, generator=gen) * 1e-3
    if kind == "shifted":
        return torch.randn(LENGTH, generator=gen) + 10.0
    # large and small magnitudes in separate halves: hard for long fp32 accumulations
    half = LENGTH // 2
    return torch.cat([torch.full((half,), 1e3), torch.full((LENGTH - half,), 1e-3)])


def _exact(tensors: list[torch.Tensor], p: float) -> float:
    whole = torch.cat([t.reshape(-1).double() for t in tensors])
    return float(torch.linalg.vector_norm(whole, p))


@pytest.mark.parametrize("kind", ["gaussian", "shifted", "two_magnitudes"])
@pytest.mark.parametrize("p", [2.0, 1.0, 3.0, math.inf])
def test_long_gradients_match_the_fp64_norm(kind: str, p: float) -> None:
    data = _data(kind)
    tensors = [data[: NORM_BLOCK + 5], data[NORM_BLOCK + 5 :].view(-1, 1)]  # ragged, 2-D
    got = global_grad_norm(tensors, norm_type=p, group=None)
    assert not got.overflow
    assert got.norm == pytest.approx(_exact(tensors, p), rel=5e-8)


@pytest.mark.parametrize("p", [2.0, 1.0, math.inf])
def test_bf16_gradients_match_the_fp64_norm(p: float) -> None:
    data = _data("gaussian")[: NORM_CHUNK + 999].bfloat16()
    got = global_grad_norm([data], norm_type=p, group=None)
    assert got.norm == pytest.approx(_exact([data], p), rel=1e-7)


@pytest.mark.parametrize("p", [2.0, 3.0])
def test_finite_values_beyond_fp32_squares_are_no_overflow(p: float) -> None:
    huge = torch.full((3 * NORM_BLOCK + 3,), 1e30)  # each block's norm overflows fp32
    got = global_grad_norm([huge, torch.ones(5)], norm_type=p, group=None)
    assert not got.overflow
    assert got.norm == pytest.approx(_exact([huge, torch.ones(5)], p), rel=1e-12)


@pytest.mark.parametrize("bad", [math.inf, math.nan])
def test_a_non_finite_value_in_a_later_chunk_is_an_overflow(bad: float) -> None:
    data = _data("gaussian")
    data[-3] = bad
    assert global_grad_norm([data], group=None).overflow
    assert global_grad_norm([data], norm_type=math.inf, group=None).overflow
    assert grad_overflow([data], group=None)
