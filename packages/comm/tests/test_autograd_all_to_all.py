"""The autograd all-to-all sends gradients back: N gloo ranks vs one differentiable reference.

The reference holds every rank's input as a leaf tensor, routes rows with split/cat (which
autograd differentiates) and back-propagates one loss summed over ranks; each rank's input
gradient must match. Compiled runs use `torch.compile(backend="aot_eager", fullgraph=True)`:
AOTAutograd traces forward and backward through the collective (inductor would add a C++
build per rank on CPU and tests nothing more about the collective).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import deepshard.comm as comm

COLS = 3


def _splits(sender: int, n: int) -> list[int]:
    """Uneven rows `sender` sends to each rank, zeros included."""
    return [(sender + 2 * j + 1) % 3 for j in range(n)]


def _input(rank: int, n: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(100 + rank)
    return torch.randn(sum(_splits(rank, n)), COLS, generator=gen)


def _weights(rank: int, rows: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(200 + rank)
    return torch.randn(rows, COLS, generator=gen)


def _loss(y: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (torch.sin(y) * w).sum()


def _rank_body(mesh: Any, compiled: bool) -> tuple[torch.Tensor, torch.Tensor]:
    rank, group = mesh.get_rank(), mesh["dp"]
    n = group.size()
    in_splits = _splits(rank, n)
    out_splits = [_splits(j, n)[rank] for j in range(n)]
    x = _input(rank, n).requires_grad_()
    w = _weights(rank, sum(out_splits))

    def step(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = comm.all_to_all_single_autograd(
            x, group=group, output_split_sizes=out_splits, input_split_sizes=in_splits
        )
        return y, _loss(y, w)

    if compiled:
        step = torch.compile(step, backend="aot_eager", fullgraph=True)
    y, loss = step(x)
    loss.backward()
    assert x.grad is not None
    return y.detach().clone(), x.grad


def _reference(n: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    xs = [_input(r, n).requires_grad_() for r in range(n)]
    parts = [x.split(_splits(r, n)) for r, x in enumerate(xs)]
    ys = [torch.cat([parts[j][r] for j in range(n)]) for r in range(n)]
    total = sum(_loss(y, _weights(r, y.shape[0])) for r, y in enumerate(ys))
    assert isinstance(total, torch.Tensor)
    total.backward()
    return [y.detach() for y in ys], [x.grad for x in xs if x.grad is not None]


@pytest.mark.parametrize(("world", "compiled"), [(2, False), (4, False), (2, True)])
def test_gradient_matches_single_process_reference(
    run_on_mesh: Any, world: int, compiled: bool
) -> None:
    results = run_on_mesh(_rank_body, world, args=(compiled,))
    ref_y, ref_grad = _reference(world)
    assert len(ref_grad) == world
    for rank, (y, grad) in enumerate(results):
        torch.testing.assert_close(y, ref_y[rank], msg=f"rank {rank}: forward")
        torch.testing.assert_close(grad, ref_grad[rank], msg=f"rank {rank}: input gradient")
