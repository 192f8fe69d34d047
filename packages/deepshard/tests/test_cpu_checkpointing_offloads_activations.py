"""``activation_checkpointing.cpu_checkpointing: true`` offloads saved activations, same training.

One ``run_on_mesh`` call on 2 gloo ranks trains a small MLP (activations of 8 × 256 elements per
rank, above `offload_saved_tensors`' default ``min_numel``) for 3 steps at ZeRO stage 2, once
without and once with ``cpu_checkpointing``. The model notes, during each forward, which
saved-tensor hooks are active, so the test sees that the engine's forward ran under an
`offload_saved_tensors` context and what that context moved.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from deepshard.testing import run_on_mesh

pytestmark = pytest.mark.slow  # the main run covers it; the package env keeps a few lighter ones

STEPS = 3
MICRO_BATCH = 8


class _Recording(torch.nn.Module):
    """An MLP 16→256→16 that records the saved-tensor context its forward runs under."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(
            torch.nn.Linear(16, 256), torch.nn.GELU(), torch.nn.Linear(256, 16)
        )
        self.contexts: list[Any] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
        self.contexts.append(None if hooks is None else getattr(hooks[0], "__self__", None))
        return self.net(x)


def _train(mesh: Any, cpu_checkpointing: bool) -> dict[str, Any]:
    import deepshard.engine as ds

    rank = mesh.get_rank()
    model = _Recording()
    config = {
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
        "zero_optimization": {"stage": 2},
        "activation_checkpointing": {"cpu_checkpointing": cpu_checkpointing},
    }
    engine, _, _, _ = ds.initialize(model, config, mesh=mesh)
    losses = []
    for step in range(STEPS):
        gen = torch.Generator().manual_seed(10 * step + rank)
        x, y = (
            torch.randn(MICRO_BATCH, 16, generator=gen),
            torch.randn(MICRO_BATCH, 16, generator=gen),
        )
        loss = torch.nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    stats = [None if c is None else c.stats for c in model.contexts]
    params = torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])
    return {"losses": losses, "stats": stats, "params": params}


def _both(mesh: Any) -> dict[bool, dict[str, Any]]:
    return {flag: _train(mesh, flag) for flag in (False, True)}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[bool, dict[str, Any]]]:
    return run_on_mesh(_both, 2, store_dir=tmp_path_factory.mktemp("cpuckpt"), timeout_s=120)


def test_losses_and_parameters_equal_the_run_without_it(ranks: list[Any]) -> None:
    for rank in ranks:
        assert rank[True]["losses"] == rank[False]["losses"]
        assert torch.equal(rank[True]["params"], rank[False]["params"])
    assert ranks[0][True]["losses"] != ranks[1][True]["losses"]  # each rank saw its own batch


def test_the_forward_ran_under_offload_and_moved_activations(ranks: list[Any]) -> None:
    for rank in ranks:
        assert rank[False]["stats"] == [None] * STEPS
        for stats in rank[True]["stats"]:
            assert stats is not None
            # Saved: the batch (8 x 16, below min_numel: kept), GELU's input and the second
            # linear's input (8 x 256 fp32 each: offloaded) and that linear's transposed
            # weight (a view of a ZeRO flat-buffer parameter: kept).
            assert (stats.saved, stats.kept_small, stats.kept_parameters) == (4, 1, 1)
            assert stats.host_copies == 2
            assert stats.host_bytes == 2 * MICRO_BATCH * 256 * 4
            assert stats.restored_copies == stats.host_copies
