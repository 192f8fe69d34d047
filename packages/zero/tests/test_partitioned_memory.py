"""Memory by counting tensor bytes on each of 4 ranks: stages 1-2 hold 1/4 of the optimizer state
and of the fp32 masters, stage 2 also 1/4 of the gradients; stage 0 holds everything (an fp32
model's parameters are its own masters there: no second copy).

Bounds are derived from the parameter count N = 1830 of the test MLP (two param groups: three
weights, three biases). Alignment pads each parameter to a multiple of 4 (fp32) or 8 (bf16)
elements and each group's bucket to a multiple of 4 × that, so a group carries at most
3·align + 4·align elements of padding: at most P = 14·align in all.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from deepshard.testing import import_beside, run_on_mesh

_training = import_beside(__file__, "_training.py")

WORLD = 4
N = sum(p.numel() for p in _training.make_model().parameters())
ADAMW_STEP_BYTES = 2 * 4  # one fp32 `step` scalar per param group (one master per group)


def _measure(mesh: Any) -> dict[Any, dict[str, int]]:
    from deepshard.interface.config import ZeroConfig
    from deepshard.zero import ZeroOptimizer

    group, rank = mesh["dp"], mesh.get_rank()
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        for stage in (0, 1, 2):
            model = _training.make_model(dtype)
            params = list(model.parameters())
            inner = torch.optim.AdamW(_training.param_groups(params), lr=_training.LR)
            zero = ZeroOptimizer(inner, group=group, config=ZeroConfig(stage=stage))
            x, y = _training.batch(0)
            mb = _training.GLOBAL_BATCH // WORLD
            rows = slice(rank * mb, (rank + 1) * mb)
            zero.backward(_training.loss_fn(model, x[rows], y[rows]))
            grads = zero.gradient_bytes()
            live_param_grads = sum(p.grad is not None for p in params)
            zero.step()
            out[(dtype, stage)] = {
                "state": zero.optimizer_state_bytes(),
                "master": zero.master_bytes(),
                "grads": grads,
                "live_param_grads": live_param_grads,
            }
    return out


def _within(value: int, low: float, high: float) -> bool:
    return low <= value <= high


@pytest.mark.slow
def test_state_masters_and_gradients_are_partitioned(tmp_path: Path) -> None:
    per_rank = run_on_mesh(_measure, WORLD, store_dir=tmp_path)
    for dtype, size in ((torch.float32, 4), (torch.bfloat16, 2)):
        pad = 14 * (16 // size)
        for counts in per_rank:
            full, s1, s2 = (counts[(dtype, s)] for s in (0, 1, 2))
            # every parameter's .grad is released into ZeRO's buffers
            assert full["live_param_grads"] == s1["live_param_grads"] == s2["live_param_grads"] == 0
            # stage 0: whole fp32 Adam state (two moments) on every rank; whole fp32 masters for
            # a bf16 model, none beyond the parameters for an fp32 one (they are the masters)
            assert _within(full["state"] - ADAMW_STEP_BYTES, 8 * N, 8 * (N + pad))
            if dtype == torch.float32:
                assert full["master"] == 0
            else:
                assert _within(full["master"], 4 * N, 4 * (N + pad))
            for part in (s1, s2):
                assert _within(
                    part["state"] - ADAMW_STEP_BYTES, 8 * N / WORLD, 8 * (N + pad) / WORLD
                )
                assert _within(part["master"], 4 * N / WORLD, 4 * (N + pad) / WORLD)
            # gradients accumulate in the model dtype (DeepSpeed's default grad_accum_dtype)
            assert _within(full["grads"], size * N, size * (N + pad))
            assert _within(s2["grads"], size * N / WORLD, size * (N + pad) / WORLD)
            # stage 1: the full local buffer plus this rank's fp32 partition until the step
            assert _within(s1["grads"] - s1["master"], size * N, size * (N + pad))
            assert s2["grads"] == pytest.approx(full["grads"] / WORLD, rel=0.05)
