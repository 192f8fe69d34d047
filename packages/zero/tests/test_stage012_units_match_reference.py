"""Stages 0-2 through ``shard(policy=ZeroPolicy(stage=k))`` + ``ZeroOptimizer(inner, sharded)``.

The model has two ``ModuleList`` blocks and a head, so it has three units (the blocks, and the
root owning the head); the inner AdamW has two param groups (weight decay on weights only) that
cut across every unit. The layouts must follow the units (three, not two), and 2 gloo ranks
must train like one process on the whole batch: the reference is torch's AdamW on an identical
model in the parent, fp32, 1e-5 relative (only the summation order differs), also with optimizer
offload to the host and to files (DeepShard's CPU Adam kernel: the same formula in another
order), whose sub-groups then take their hyper-parameters from the param group of their range
(``SubGroup.hyper``, checked to occur). Bad input: a
stage other than the sharded module's, a parameter the sharded module does not own, and
gradient settings passed next to a sharded module are refused with the key named.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from deepshard.interface.config import ZeroConfig
from deepshard.interface.errors import ConfigError
from deepshard.testing import run_on_mesh

STEPS, BATCH, LR, GA = 4, 8, 1e-2, 2


class _Blocks(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList([torch.nn.Linear(13, 37), torch.nn.Linear(37, 29)])
        self.head = torch.nn.Linear(29, 7)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.tanh(block(x))
        out: torch.Tensor = self.head(x)
        return out


def _model() -> _Blocks:
    torch.manual_seed(0)
    return _Blocks()


def _inner(model: torch.nn.Module) -> torch.optim.Optimizer:
    decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
    rest = [p for n, p in model.named_parameters() if not n.endswith("weight")]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=LR)


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(BATCH, 13, generator=g), torch.randn(BATCH, 7, generator=g)


def _train(mesh: Any, stage: int, offload: dict[str, Any] | None = None) -> dict[str, Any]:
    from deepshard.zero import ZeroOptimizer, ZeroPolicy, shard

    group, rank, world = mesh["dp"], mesh.get_rank(), mesh["dp"].size()
    model = _model()
    inner = _inner(model)
    policy = ZeroPolicy(stage=stage, reduce_bucket_size=600, overlap_comm=stage == 2)
    sharded = shard(model, group=group, policy=policy)
    extra: dict[str, Any] = {} if offload is None else {"offload_optimizer": offload}
    config = ZeroConfig(stage=stage, overlap_comm=stage == 2, sub_group_size=200, **extra)
    zero = ZeroOptimizer(inner, sharded, config=config, gradient_clipping=0.0)
    mb = BATCH // (world * GA)
    losses = []
    for step in range(STEPS):
        x, y = _batch(step)
        for m in range(GA):
            rows = slice((m * world + rank) * mb, (m * world + rank + 1) * mb)
            loss = torch.nn.functional.mse_loss(model(x[rows]), y[rows]) / GA
            zero.backward(loss, is_boundary=m == GA - 1)
            losses.append(loss.item())
        zero.step()
    subs = [] if zero._offload is None else zero._offload.sub_groups
    return {
        "hyper_sub_groups": sum(sub.hyper is not None for sub in subs),
        "units": [u.name for u in sharded.units],  # type: ignore[union-attr]
        "buckets": [len(layout.buckets) for layout in zero.layouts],
        "inner_groups": [len(g["params"]) for g in zero.param_groups],
        "losses": losses,
        "params": [p.detach().clone() for p in model.parameters()],
    }


def _train_all(mesh: Any, root: str) -> dict[Any, dict[str, Any]]:
    results: dict[Any, dict[str, Any]] = {stage: _train(mesh, stage) for stage in (0, 1, 2)}
    # optimizer offload over the same units: each sub-group is stepped with the hyper-parameters
    # of the one param group its range belongs to (the CPU Adam kernel; NVMe through files)
    results["cpu"] = _train(mesh, 1, {"device": "cpu"})
    nvme = {"device": "nvme", "nvme_path": root}  # mkdtemp makes a directory per rank
    results["nvme"] = _train(mesh, 2, nvme)
    return results


def _reference() -> list[torch.Tensor]:
    model = _model()
    inner = _inner(model)
    for step in range(STEPS):
        x, y = _batch(step)
        inner.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        inner.step()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.slow
def test_units_decide_the_layouts_and_training_matches_one_process(tmp_path: Path) -> None:
    ref = _reference()
    root = tmp_path / "swap"
    root.mkdir()
    for per_rank in run_on_mesh(_train_all, 2, args=(str(root),), store_dir=tmp_path):
        assert per_rank["cpu"]["hyper_sub_groups"] > 0 and per_rank["nvme"]["hyper_sub_groups"] > 0
        for stage, result in per_rank.items():
            # the root (head) first, then each block: one layout per unit, not per param group
            assert result["units"] == ["", "blocks.0", "blocks.1"], stage
            assert len(result["buckets"]) == 3 and max(result["buckets"]) > 1, stage
            if stage in (0, 1, 2):  # the CPU Adam kernel's groups hold no tensors, by design
                assert all(count > 0 for count in result["inner_groups"]), stage
            for got, want in zip(result["params"], ref, strict=True):
                err = float((got - want).abs().max() / want.abs().max())
                assert err < 1e-5, (stage, err)


def _refusals(mesh: Any) -> list[str]:
    from deepshard.interface.config import ZeroConfig as Config
    from deepshard.zero import GradientReduction, ZeroOptimizer, ZeroPolicy, shard

    model = _model()
    sharded = shard(model, group=mesh["dp"], policy=ZeroPolicy(stage=2))
    messages = []
    for inner, kwargs in (
        (_inner(model), {"config": Config(stage=1)}),
        (torch.optim.AdamW([torch.nn.Parameter(torch.ones(3))]), {}),
        (_inner(model), {"reduction": GradientReduction()}),
    ):
        with pytest.raises(ConfigError) as caught:
            ZeroOptimizer(inner, sharded, **kwargs)
        messages.append(str(caught.value))
    return messages


@pytest.mark.slow
def test_bad_input_names_the_key(tmp_path: Path) -> None:
    [stage, stranger, extra] = run_on_mesh(_refusals, 1, store_dir=tmp_path)[0]
    assert "zero_optimization.stage" in stage and "sharded at stage 2" in stage
    assert "not one of the sharded model's trainable parameters" in stranger
    assert "ZeroOptimizer(reduction=)" in extra
