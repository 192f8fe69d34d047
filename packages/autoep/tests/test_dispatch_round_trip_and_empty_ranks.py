"""Dispatch/combine move rows to their experts' ranks and back, gradients included.

Without processes: `local_expert_order` regroups (source, local expert) blocks into local
expert blocks (checked against a list built by hand), and `GroupedExperts` equals a per-expert
loop written here, including an expert with no rows and a rank with no rows at all, whose
(empty) output must still reach back to its input (else that rank would skip the dispatch
all-to-all in backward while its peers wait). On CPU the grouped path (``torch._grouped_mm``)
equals the looped one in values and gradients, and a ``_grouped_mm`` with a wrong backward is
refused by the probe (the loop runs instead).

On 2 gloo ranks: each rank sends rows tagged with (source rank, global expert) to the owners
of the experts; the owner must receive exactly the tags of its experts, grouped by source, and
the counts table must say how many; combine must give back the rows in the sender's order, and
the gradient of a dispatch → scale → combine round trip must be the scale on every row. In one
case rank 1 neither sends nor receives a row, so an empty rank is exercised for real.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from deepshard.autoep import AllToAllTransport, GroupedExperts, _grouped_experts
from deepshard.autoep._dispatch import local_expert_order
from deepshard.interface import ExpertTransport, Topology
from deepshard.testing import run_on_mesh

# multi-rank and over ~3 s: the main run covers it, the package tox env deselects it
pytestmark = pytest.mark.slow


def test_local_order_groups_rows_by_local_expert() -> None:
    counts = torch.tensor([[2, 1], [1, 2]])  # rows from source s for local expert e
    received = ["s0e0a", "s0e0b", "s0e1", "s1e0", "s1e1a", "s1e1b"]
    local = local_expert_order(counts)
    grouped = [received[i] for i in local.order.tolist()]
    assert grouped == ["s0e0a", "s0e0b", "s1e0", "s0e1", "s1e1a", "s1e1b"]
    assert local.group_sizes.tolist() == [3, 3]
    assert [grouped[i] for i in local.inverse.tolist()] == received


def test_interleaved_sources_are_regrouped() -> None:
    counts = torch.tensor([[1, 1], [1, 1]])
    received = ["s0e0", "s0e1", "s1e0", "s1e1"]
    local = local_expert_order(counts)
    assert [received[i] for i in local.order.tolist()] == ["s0e0", "s1e0", "s0e1", "s1e1"]


def _experts(num: int) -> GroupedExperts:
    gen = torch.Generator().manual_seed(0)
    gate_up = torch.nn.Parameter(torch.randn(num, 12, 8, generator=gen))
    down = torch.nn.Parameter(torch.randn(num, 8, 6, generator=gen))
    return GroupedExperts(gate_up, down, F.silu)


def test_grouped_experts_equal_a_loop_over_experts() -> None:
    experts = _experts(3)
    x = torch.randn(7, 8, requires_grad=True)
    sizes = torch.tensor([4, 0, 3])
    out = experts(x, sizes)
    expected = []
    for e, block in zip((0, 2), (x[:4], x[4:]), strict=True):
        gate, up = (block @ experts.gate_up_proj[e].T).chunk(2, dim=-1)
        expected.append((F.silu(gate) * up) @ experts.down_proj[e].T)
    torch.testing.assert_close(out, torch.cat(expected))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_grouped_mm_path_equals_the_loop_path_with_gradients(dtype: torch.dtype) -> None:
    # The workspace's torch has a CPU _grouped_mm whose backward agrees, so the probe admits it
    # and the same experts run both ways: grouped, and looped (use_grouped_mm=False).
    gen = torch.Generator().manual_seed(1)
    gate_up = torch.randn(4, 32, 16, generator=gen).to(dtype)
    down = torch.randn(4, 16, 16, generator=gen).to(dtype)
    x = torch.randn(11, 16, generator=gen).to(dtype)
    sizes = torch.tensor([0, 6, 0, 5])  # empty groups first and in the middle
    grad_out = torch.randn(11, 16, generator=gen).to(dtype)
    results = []
    for grouped in (True, False):
        experts = GroupedExperts(
            torch.nn.Parameter(gate_up.clone()),
            torch.nn.Parameter(down.clone()),
            F.silu,
            grad_scale=0.5,
            use_grouped_mm=grouped,
        )
        rows = x.clone().requires_grad_(True)
        assert experts.uses_grouped_mm(rows) is grouped
        out = experts(rows, sizes)
        out.backward(grad_out)
        assert experts.gate_up_proj.grad is not None and experts.down_proj.grad is not None
        results.append((out, rows.grad, experts.gate_up_proj.grad, experts.down_proj.grad))
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 5e-2}
    for got, want in zip(*results, strict=True):
        torch.testing.assert_close(got, want, **tol)
    assert not results[0][2][[0, 2]].any()  # experts without rows get no gradient


def test_a_sum_loss_backpropagates_through_the_grouped_path() -> None:
    # out.sum() hands back an expanded (zero-stride) gradient, which CPU _grouped_mm's
    # backward refuses on its own ("Invalid strides/sizes").
    gen = torch.Generator().manual_seed(2)
    gate_up, down = torch.randn(3, 32, 16, generator=gen), torch.randn(3, 16, 16, generator=gen)
    x = torch.randn(7, 16, generator=gen)
    grads = []
    for grouped in (True, False):
        experts = GroupedExperts(
            torch.nn.Parameter(gate_up.clone()),
            torch.nn.Parameter(down.clone()),
            F.silu,
            use_grouped_mm=grouped,
        )
        rows = x.clone().requires_grad_(True)
        assert experts.uses_grouped_mm(rows) is grouped
        experts(rows, torch.tensor([4, 0, 3])).sum().backward()
        grads.append((rows.grad, experts.gate_up_proj.grad, experts.down_proj.grad))
    for got, want in zip(*grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_cpu_grouped_mm_with_a_wrong_backward_is_not_used(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    real = torch._grouped_mm

    class _WrongBackward(torch.autograd.Function):
        """The real forward; a backward of the right shapes but zero values."""

        @staticmethod
        def forward(ctx: Any, a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> Any:
            ctx.shapes = (a.shape, b.shape)
            return real(a, b, offs=offs)

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> Any:
            a_shape, b_shape = ctx.shapes
            return grad.new_zeros(a_shape), grad.new_zeros(b_shape), None

    def wrong(a: torch.Tensor, b: torch.Tensor, *, offs: torch.Tensor) -> torch.Tensor:
        return _WrongBackward.apply(a, b, offs)

    agrees = _grouped_experts._cpu_grouped_mm_agrees
    agrees.cache_clear()
    monkeypatch.setattr(torch, "_grouped_mm", wrong)
    try:
        experts = _experts(3)
        x = torch.randn(7, 8, requires_grad=True)
        assert not experts.uses_grouped_mm(x)
        out = experts(x, torch.tensor([4, 0, 3]))  # the loop runs instead, gradients intact
        out.sum().backward()
        assert x.grad is not None and experts.gate_up_proj.grad is not None
    finally:
        agrees.cache_clear()


def test_a_rank_without_rows_keeps_its_input_and_weights_in_the_graph() -> None:
    experts = _experts(2)
    x = torch.randn(0, 8, requires_grad=True)
    out = experts(x, torch.tensor([0, 0]))
    out.sum().backward()
    assert out.shape == (0, 8) and x.grad is not None
    assert experts.gate_up_proj.grad is not None and not experts.gate_up_proj.grad.any()


def _round_trip(mesh: Any, rank1_sends: bool) -> dict[str, Any]:
    rank = mesh.get_rank()
    transport = AllToAllTransport(mesh["ep"])
    assert isinstance(transport, ExpertTransport)
    counts = torch.tensor([2, 1, 0, 3]) if rank == 0 else torch.tensor([1, 0, 2, 1])
    if not rank1_sends:  # rank 1 neither sends nor receives a row
        counts = torch.tensor([2, 1, 0, 0]) if rank == 0 else torch.zeros(4, dtype=torch.int64)
    experts = torch.repeat_interleave(torch.arange(4), counts)
    # Each row carries (source rank, global expert, position) so the receiver can check it.
    rows = torch.stack(
        [torch.full_like(experts, rank), experts, torch.arange(experts.numel())], dim=1
    ).float()
    rows.requires_grad_(True)
    received, received_counts, plan = transport.dispatch(rows, counts)
    back = transport.combine(received * (2.0 + rank), plan)
    back.sum().backward()
    return {
        "received": received.detach().tolist(),
        "counts": received_counts.tolist(),
        "back": back.detach().tolist(),
        "rows": rows.detach().tolist(),
        "grad": rows.grad.tolist() if rows.grad is not None else None,
    }


@pytest.mark.timeout(200)
@pytest.mark.parametrize("rank1_sends", [True, False], ids=["both-send", "rank1-empty"])
def test_rows_reach_their_experts_and_come_back(rank1_sends: bool, tmp_path: Path) -> None:
    results = run_on_mesh(
        _round_trip, 2, topology=Topology(ep=2), args=(rank1_sends,), store_dir=tmp_path
    )
    sent = [r["rows"] for r in results]
    for owner, res in enumerate(results):
        mine = [row for src in sent for row in src if int(row[1]) // 2 == owner]
        assert res["received"] == mine  # grouped by source rank, expert order within
        table = [[sum(int(r[1]) == 2 * owner + e for r in src) for e in range(2)] for src in sent]
        assert res["counts"] == table
    for rank, res in enumerate(results):
        # Rows came back where they started, each scaled by its owner's factor.
        scale = [2.0 + int(row[1]) // 2 for row in res["rows"]]
        assert res["back"] == [
            [v * s for v in row] for row, s in zip(res["rows"], scale, strict=True)
        ]
        assert res["grad"] == [[s] * 3 for s in scale], rank
