"""How gradients are scaled around the reduction: DeepSpeed's mean/sum, prescale and predivide
semantics, as factors (pure) and as results of a real reduction on 2 and 4 gloo ranks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from deepshard.interface.errors import ConfigError
from deepshard.testing import run_on_mesh
from deepshard.zero import GradientReduction, reduce_bucket

SETTINGS = [
    GradientReduction(),
    GradientReduction(op="sum"),
    GradientReduction(prescale=True),
    GradientReduction(predivide_factor=8.0),
    GradientReduction(predivide_factor=2.0),
    GradientReduction(op="sum", prescale=True, predivide_factor=8.0),
    GradientReduction(dtype=torch.bfloat16),
]


@pytest.mark.parametrize("world", [1, 2, 4])
def test_factors_follow_deepspeed(world: int) -> None:
    # DeepSpeed: sum -> no scaling; mean + postscale -> x/f, sum, x*f/W (skipped when f == W);
    # mean + prescale -> x/W, sum.
    assert GradientReduction(op="sum").pre_factor(world) == 1.0
    assert GradientReduction(op="sum").post_factor(world) == 1.0
    assert GradientReduction().pre_factor(world) == 1.0
    assert GradientReduction().post_factor(world) == (1.0 if world == 1 else 1.0 / world)
    assert GradientReduction(prescale=True).pre_factor(world) == 1.0 / world
    assert GradientReduction(prescale=True).post_factor(world) == 1.0
    pre = GradientReduction(predivide_factor=2.0)
    assert pre.pre_factor(world) == 0.5
    assert pre.post_factor(world) == (1.0 if world == 2 else 2.0 / world)
    for setting in SETTINGS:  # mean really is a mean, sum a sum
        product = setting.pre_factor(world) * setting.post_factor(world)
        assert product == pytest.approx(1.0 if setting.op == "sum" else 1.0 / world)


def test_bad_settings_name_the_key() -> None:
    with pytest.raises(ConfigError, match="gradient_allreduce_op"):
        GradientReduction(op="max")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="gradient_predivide_factor"):
        GradientReduction(predivide_factor=0.0)
    with pytest.raises(ConfigError, match="communication_data_type"):
        GradientReduction.from_names(dtype="int8")
    assert GradientReduction.from_names(dtype="bf16").dtype == torch.bfloat16
    assert GradientReduction().comm_dtype(torch.float16) == torch.float16
    assert GradientReduction(dtype=torch.float32).comm_dtype(torch.float16) == torch.float32


def _rank_grads(rank: int) -> torch.Tensor:
    return torch.arange(8, dtype=torch.float32) * (rank + 1) + 0.25


def _reduce_everything(mesh: Any) -> list[dict[str, torch.Tensor]]:
    group, rank = mesh["dp"], mesh.get_rank()
    out = []
    for setting in SETTINGS:
        dtype = setting.comm_dtype(torch.float32)
        results = {}
        for scatter, use_rs in ((False, True), (True, True), (True, False)):
            bucket = _rank_grads(rank).to(dtype)
            pending = reduce_bucket(
                bucket,
                group=group,
                reduction=setting,
                scatter=scatter,
                use_reduce_scatter=use_rs,
                async_op=True,
            )
            results[f"{scatter}-{use_rs}"] = pending.wait().float().clone()
        out.append(results)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_reductions_give_the_mean_or_sum(world: int, tmp_path: Path) -> None:
    per_rank = run_on_mesh(_reduce_everything, world, store_dir=tmp_path)
    total = sum(_rank_grads(r) for r in range(world))
    chunk = 8 // world
    for i, setting in enumerate(SETTINGS):
        want = total if setting.op == "sum" else total / world
        tol = 1e-2 if setting.dtype == torch.bfloat16 else 1e-6
        for rank, all_results in enumerate(per_rank):
            results = all_results[i]
            mine = want[rank * chunk : (rank + 1) * chunk]
            torch.testing.assert_close(results["False-True"], want, rtol=tol, atol=0)
            torch.testing.assert_close(results["True-True"], mine, rtol=tol, atol=0)
            torch.testing.assert_close(results["True-False"], mine, rtol=tol, atol=0)
