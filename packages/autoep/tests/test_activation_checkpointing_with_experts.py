"""Activation checkpointing over expert-parallel layers gives the gradients it gives without.

Hugging Face's non-reentrant gradient checkpointing recomputes each decoder layer in backward
and refuses the backward when the recomputation saves a different number of tensors than the
forward did. The CPU grouped-GEMM probe runs once per process, on the first expert forward: it
used to run inside the checkpointed forward, so the forward saved the probe's tensors and the
recomputation (probe cached by then) did not — every first backward failed. On 2 gloo ranks
(EP = 2, the overlapped exchange, whose all-to-alls are issued again by the recomputation) the
probe's cache is cleared first, and a tiny Mixtral's loss and every gradient with checkpointing
must equal those without.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from deepshard.autoep import _grouped_experts, parallelize_experts
from deepshard.comm import ParallelDims
from deepshard.interface import Topology
from deepshard.testing import import_beside, run_on_mesh

_tiny_moe = import_beside(__file__, "_tiny_moe.py")

pytestmark = pytest.mark.slow  # multi-rank: the main run covers it


def _grads(mesh: Any) -> dict[str, Any]:
    dims = ParallelDims.from_mesh(mesh)
    rank = mesh.get_rank()
    ids = _tiny_moe.batch(0, rank)
    results = {}
    for checkpointed in (True, False):
        model = _tiny_moe.build("mixtral")
        parallelize_experts(model, dims)
        model.train()
        if checkpointed:
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False}
            )
            _grouped_experts._cpu_grouped_mm_agrees.cache_clear()  # probe inside the forward
        loss = _tiny_moe.loss_of(model, ids)
        loss.backward()
        results[checkpointed] = {
            "loss": loss.detach(),
            "grads": {n: p.grad for n, p in model.named_parameters() if p.grad is not None},
        }
    return results


@pytest.mark.timeout(300)
def test_checkpointed_layers_give_the_same_gradients(tmp_path: Path) -> None:
    results = run_on_mesh(_grads, 2, topology=Topology(ep=2), store_dir=tmp_path)
    for rank, result in enumerate(results):
        with_, without = result[True], result[False]
        torch.testing.assert_close(with_["loss"], without["loss"], rtol=0, atol=0)
        assert with_["grads"].keys() == without["grads"].keys(), rank
        assert any("experts" in name for name in with_["grads"]), rank
        for name, grad in without["grads"].items():
            torch.testing.assert_close(
                with_["grads"][name], grad, rtol=1e-6, atol=1e-6, msg=f"rank {rank} {name}"
            )
