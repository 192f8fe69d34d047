"""``partition_activations`` on a tp=2 mesh: each rank keeps half of every checkpointed input.

One ``run_on_mesh`` call on 2 gloo ranks (Topology(tp=2)): each rank runs a stack of blocks
whose inputs (3 × 5 = 15 elements, odd, so the last chunk is padded) are the same on both tp
ranks, once plain and once checkpointed with the inputs partitioned over ``mesh["tp"]`` (also
with cpu checkpointing and the contiguous buffer). The gradients equal the plain run's, and
each rank kept ``ceil(15 / 2)`` elements per input.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from deepshard.interface import Topology
from deepshard.testing import run_on_mesh

pytestmark = pytest.mark.slow  # the main run covers it; the package env keeps a few lighter ones

ROWS, HIDDEN, BLOCKS = 3, 5, 3


def _blocks() -> torch.nn.ModuleList:
    torch.manual_seed(0)
    return torch.nn.ModuleList(
        torch.nn.Sequential(
            torch.nn.Linear(HIDDEN, 4 * HIDDEN),
            torch.nn.Tanh(),
            torch.nn.Linear(4 * HIDDEN, HIDDEN),
        )
        for _ in range(BLOCKS)
    )


def _grads(checkpointer: Any) -> list[torch.Tensor]:
    blocks = _blocks()
    torch.manual_seed(1)  # the same input on both tp ranks
    x = torch.randn(ROWS, HIDDEN, requires_grad=True)
    h = x * 1.0
    for block in blocks:
        h = block(h) if checkpointer is None else checkpointer.checkpoint(block, h)
    (h.square().sum()).backward()
    assert x.grad is not None
    return [x.grad, *(p.grad for p in blocks.parameters() if p.grad is not None)]


def _rank(mesh: Any) -> dict[str, Any]:
    from deepshard.engine.checkpointing import Checkpointer
    from deepshard.interface.config import ActivationCheckpointingConfig

    results: dict[str, Any] = {"plain": _grads(None)}
    for name, extra in (
        ("partitioned", {}),
        (
            "partitioned_cpu_contiguous",
            {
                "cpu_checkpointing": True,
                "contiguous_memory_optimization": True,
                "number_checkpoints": BLOCKS,
            },
        ),
    ):
        config = ActivationCheckpointingConfig(partition_activations=True, **extra)
        checkpointer = Checkpointer(config, tp=mesh["tp"])
        results[name] = _grads(checkpointer)
        results[f"{name}_bytes"] = checkpointer.stats.kept_input_bytes
    return results


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_on_mesh(
        _rank, 2, topology=Topology(tp=2), store_dir=tmp_path_factory.mktemp("part"), timeout_s=90
    )


@pytest.mark.parametrize("name", ["partitioned", "partitioned_cpu_contiguous"])
def test_gradients_equal_the_unpartitioned_run(ranks: list[dict[str, Any]], name: str) -> None:
    for rank in ranks:
        assert len(rank[name]) == len(rank["plain"])
        for got, expected in zip(rank[name], rank["plain"], strict=True):
            assert torch.equal(got, expected)


@pytest.mark.parametrize("name", ["partitioned", "partitioned_cpu_contiguous"])
def test_each_rank_keeps_half_of_every_input(ranks: list[dict[str, Any]], name: str) -> None:
    per_input = -(-ROWS * HIDDEN // 2) * 4  # ceil(15 / 2) fp32 elements
    for rank in ranks:
        assert rank[f"{name}_bytes"] == BLOCKS * per_input
        assert rank[f"{name}_bytes"] < BLOCKS * ROWS * HIDDEN * 4
