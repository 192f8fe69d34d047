"""`torch.compile` of a module using the exchange: gradients equal eager and are not zero.

DeepSpeed's compiled exchange traced into a collective that filled a pre-allocated buffer; the
graph's output did not depend on its input and every gradient upstream of it was zero (v0.19.7,
#8491). Here the exchange is the registered op `deepshard_sp::all_to_all`, which dynamo and
AOTAutograd treat as an opaque op with a fake shape and a registered derivative. A projection ->
DistributedAttention (GQA, uneven 6 query / 3 KV heads) -> projection block is compiled with
`backend="aot_eager", fullgraph=True` on 2 gloo ranks; its output, input gradient and weight
gradients must equal the eager run on the same rank, also with ``overlap=True`` (which compiles
to the synchronous op).
"""

from __future__ import annotations

from typing import Any

import torch

from deepshard.sequence_parallel import DistributedAttention
from deepshard.testing import import_beside

_cases = import_beside(__file__, "_attention_cases.py")

B, S_LOCAL, E, HQ, HKV, D = 2, 4, 12, 6, 3, 4


class Block(torch.nn.Module):
    """Batch-first attention block whose core runs over the sequence-parallel group."""

    def __init__(self, group: Any, overlap: bool = False) -> None:
        super().__init__()
        self.qkv = torch.nn.Linear(E, (HQ + 2 * HKV) * D, dtype=torch.float64)
        self.out = torch.nn.Linear(HQ * D, E, dtype=torch.float64)
        self.attn = DistributedAttention(_cases.sdpa_local, group, overlap=overlap)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).view(B, S_LOCAL, HQ + 2 * HKV, D).split([HQ, HKV, HKV], dim=2)
        return self.out(self.attn(q, k, v, 0, 0).reshape(B, S_LOCAL, HQ * D))


def _step(block: Block, run: Any, rank: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(50 + rank)
    x = torch.randn(B, S_LOCAL, E, generator=gen, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(B, S_LOCAL, E, generator=gen, dtype=torch.float64)
    y = run(x)
    (y * weight).sum().backward()
    assert x.grad is not None
    grads = {f"grad.{n}": p.grad for n, p in block.named_parameters() if p.grad is not None}
    return {"y": y.detach(), "x.grad": x.grad, **grads}


def _rank_body(mesh: Any) -> list[dict[str, torch.Tensor]]:
    rank = mesh.get_rank()
    torch.manual_seed(0)
    eager = Block(mesh["dp"])
    results = [_step(eager, eager, rank)]
    # overlap=True compiles to the synchronous op (its hooks and async launch are eager-only).
    for overlap in (False, True):
        compiled = Block(mesh["dp"], overlap=overlap)
        compiled.load_state_dict(eager.state_dict())
        graph = torch.compile(compiled, backend="aot_eager", fullgraph=True)
        results.append(_step(compiled, graph, rank))
    return results


def test_compiled_gradients_equal_eager_and_are_not_zero(run_on_mesh: Any) -> None:
    for rank, (eager, *compiled_runs) in enumerate(run_on_mesh(_rank_body, 2, timeout_s=280.0)):
        assert len(eager) == 6
        for name, want in eager.items():
            assert want.abs().sum() > 0, f"rank {rank}: eager {name} is all zero"
        for index, compiled in enumerate(compiled_runs):
            assert compiled.keys() == eager.keys()
            for name, want in eager.items():
                msg = f"rank {rank} run {index}: {name}"
                torch.testing.assert_close(compiled[name], want, msg=msg)
