"""`copy_to_group` and `reduce_from_group` on 2 gloo ranks vs one differentiable reference.

A column-then-row split MLP, as tensor parallelism runs it: every rank holds the whole input
``x``, its columns ``a_r`` of the first weight and its rows ``b_r`` of the second, and computes
``reduce_from(tanh(copy_to(x) @ a_r) @ b_r)``, the whole output on every rank. The reference
computes ``tanh(x @ A) @ B`` with the whole weights in one process: the outputs, the gradient
of ``x`` (summed over the ranks' parts by `copy_to_group`'s backward) and each rank's weight
gradients (its slice of the reference's) must agree.
"""

from __future__ import annotations

from typing import Any

import torch

import deepshard.comm as comm

ROWS, IN, HIDDEN, OUT, RANKS = 3, 4, 6, 5, 2


def _whole() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    x, a = torch.randn(ROWS, IN, generator=gen), torch.randn(IN, HIDDEN, generator=gen)
    b, w = torch.randn(HIDDEN, OUT, generator=gen), torch.randn(ROWS, OUT, generator=gen)
    return x, a, b, w


def _on_rank(mesh: Any) -> dict[str, torch.Tensor]:
    rank, width = mesh.get_rank(), HIDDEN // RANKS
    x, a, b, w = _whole()
    x.requires_grad_(True)
    a_r = a[:, rank * width : (rank + 1) * width].clone().requires_grad_(True)
    b_r = b[rank * width : (rank + 1) * width].clone().requires_grad_(True)
    group = mesh["dp"].get_group()
    hidden = torch.tanh(comm.copy_to_group(x, group=group) @ a_r)
    out = comm.reduce_from_group(hidden @ b_r, group=group)
    (out * w).sum().backward()
    assert x.grad is not None and a_r.grad is not None and b_r.grad is not None
    return {"out": out.detach(), "x": x.grad, "a": a_r.grad, "b": b_r.grad}


def test_split_mlp_matches_one_process(run_on_mesh: Any) -> None:
    x, a, b, w = _whole()
    for t in (x, a, b):
        t.requires_grad_(True)
    out = torch.tanh(x @ a) @ b
    (out * w).sum().backward()
    assert x.grad is not None and a.grad is not None and b.grad is not None
    width = HIDDEN // RANKS
    for rank, got in enumerate(run_on_mesh(_on_rank, RANKS)):
        cols = slice(rank * width, (rank + 1) * width)
        torch.testing.assert_close(got["out"], out.detach())
        torch.testing.assert_close(got["x"], x.grad)  # whole: both parts summed
        torch.testing.assert_close(got["a"], a.grad[:, cols])
        torch.testing.assert_close(got["b"], b.grad[cols])
