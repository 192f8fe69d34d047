"""Muon under ZeRO, on 2 ranks at stages 0, 1 and 2: a step skipped for a non-finite gradient in
*one* matrix on *one* rank leaves every momentum (also those of the finite matrices), master,
Adam moment and parameter as it was; a loss scale is undone before Newton–Schulz, so scaled
training equals unscaled training; the momentum takes the gradient's dtype (bf16 model → bf16,
``grad_accum_dtype`` fp32 → fp32) and survives ``state_dict``/``load_state_dict``.
"""

from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from deepshard.testing import import_beside, run_on_mesh

_muon = import_beside(__file__, "_muon_training.py")
_training = _muon._training

WORLD = 2
SCALE = 1024.0
POISONED = "4.weight"  # only this matrix's gradient turns non-finite, only on rank 1


def _snapshot(model: torch.nn.Module, zero: Any) -> list[torch.Tensor]:
    state = zero.state_dict()
    inner = [v for s in state["optimizer"]["state"].values() for v in s.values()]
    return [
        *(p.detach().clone() for p in model.parameters()),
        *state["master_partitions"],
        *(v for v in inner if isinstance(v, torch.Tensor)),
        *state["full_grad_buffers"].values(),
    ]


def _run(group: Any, stage: int, *, poison: int | None, scale: float) -> dict[str, Any]:
    """Four steps; at step ``poison`` rank 1's gradient of `POISONED` becomes inf/NaN."""
    rank = group.get_rank()
    model = _training.make_model()
    zero = _muon.wrap(model, group, stage=stage, reduce_bucket_size=2000, overlap_comm=True)
    weight = dict(model.named_parameters())[POISONED]
    flags, unchanged = [], True
    for step in range(4):
        hook = None
        if step == poison and rank == 1:
            hook = weight.register_hook(lambda grad: grad * math.inf)
        before = _snapshot(model, zero)
        x, y = _muon.micro_batch(step, rank, WORLD, 1, 0)
        zero.backward(_training.loss_fn(model, x, y) * scale)
        result = zero.step(loss_scale=scale)
        flags.append(result.overflow)
        if hook is not None:
            hook.remove()
        if step == poison:
            after = _snapshot(model, zero)
            unchanged = all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
            unchanged = unchanged and len(before) == len(after)
    buffers = zero.state_dict()["full_grad_buffers"]
    return {
        "flags": flags,
        "unchanged": unchanged,
        "buffers": sorted(buffers),
        "params": [p.detach().clone() for p in model.parameters()],
    }


def _bf16_roundtrip(group: Any, stage: int) -> dict[str, Any]:
    """bf16 model: 2 steps, save, 2 more; a fresh model and wrapper loads the save, does 2 steps."""
    rank = group.get_rank()

    def train(model: torch.nn.Module, zero: Any, steps: range) -> None:
        for step in steps:
            x, y = _muon.micro_batch(step, rank, WORLD, 1, 0)
            zero.backward(_training.loss_fn(model, x, y))
            assert not zero.step().overflow

    model = _training.make_model(torch.bfloat16)
    zero = _muon.wrap(model, group, stage=stage)
    train(model, zero, range(2))
    # deep-copied as a checkpoint on disk would be (the inner state dict holds live tensors)
    saved = copy.deepcopy(zero.state_dict())
    train(model, zero, range(2, 4))
    fresh = _training.make_model(torch.bfloat16, seed=7)
    resumed = _muon.wrap(fresh, group, stage=stage)
    resumed.load_state_dict(saved)
    train(fresh, resumed, range(2, 4))
    widened = _training.make_model(torch.bfloat16)
    fp32_accum = _muon.wrap(widened, group, stage=stage, grad_accum_dtype=torch.float32)
    train(widened, fp32_accum, range(1))
    return {
        "dtypes": [b.dtype for b in saved["full_grad_buffers"].values()],
        "fp32_accum_dtypes": [
            b.dtype for b in fp32_accum.state_dict()["full_grad_buffers"].values()
        ],
        "continued": [p.detach().clone() for p in model.parameters()],
        "resumed": [p.detach().clone() for p in fresh.parameters()],
        "buffers": [
            zero.state_dict()["full_grad_buffers"],
            resumed.state_dict()["full_grad_buffers"],
        ],
    }


def _all(mesh: Any) -> dict[str, Any]:
    group = mesh["dp"]
    out: dict[str, Any] = {}
    for stage in (0, 1, 2):
        out[f"poison{stage}"] = _run(group, stage, poison=2, scale=1.0)
        out[f"plain{stage}"] = _run(group, stage, poison=None, scale=1.0)
        out[f"scaled{stage}"] = _run(group, stage, poison=None, scale=SCALE)
        out[f"bf16{stage}"] = _bf16_roundtrip(group, stage)
    return out


@pytest.mark.slow
def test_skipped_step_loss_scale_dtype_and_resume(tmp_path: Path) -> None:
    per_rank = run_on_mesh(_all, WORLD, store_dir=tmp_path)
    matrices = sorted(n for n, p in _training.make_model().named_parameters() if p.dim() == 2)
    for out in per_rank:
        for stage in (0, 1, 2):
            poisoned = out[f"poison{stage}"]
            assert poisoned["flags"] == [False, False, True, False], stage
            assert poisoned["unchanged"], f"stage {stage}: the skipped step changed state"
            # stage 0 transforms every matrix on every rank; 1-2 those with a piece on the rank
            # (at 2 ranks the 1073-element matrix is cut in the middle of the bucket)
            owned = poisoned["buffers"]
            assert owned == matrices if stage == 0 else set(owned) < set(matrices), owned
            plain, scaled = out[f"plain{stage}"], out[f"scaled{stage}"]
            for a, b in zip(scaled["params"], plain["params"], strict=True):
                torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
            bf16 = out[f"bf16{stage}"]
            assert bf16["dtypes"] and set(bf16["dtypes"]) == {torch.bfloat16}
            assert set(bf16["fp32_accum_dtypes"]) == {torch.float32}
            for a, b in zip(bf16["resumed"], bf16["continued"], strict=True):
                assert torch.equal(a, b), f"stage {stage}: resumed run differs"
            continued, resumed = bf16["buffers"]
            assert continued.keys() == resumed.keys()
            assert all(torch.equal(continued[n], resumed[n]) for n in continued)
    for key in per_rank[0]:  # both ranks end with the same model
        if "params" in per_rank[0][key]:
            for a, b in zip(per_rank[0][key]["params"], per_rank[1][key]["params"], strict=True):
                assert torch.equal(a, b), key
    union = set(per_rank[0]["poison1"]["buffers"]) | set(per_rank[1]["poison1"]["buffers"])
    assert union == set(matrices)  # every matrix is transformed by some rank
