"""An AdamW built before `parallelize_experts` trains the new experts in their sources' group.

The optimizer has two groups (experts and routers: one learning rate and no weight decay; the
rest: another of each) and takes one step on the whole model before the replacement, so it
holds moments for the full expert tensors. After `parallelize_experts(..., optimizer=opt)`, no
discarded tensor may remain in a group or in the state, each new expert parameter must sit in
the experts' group with its moments sliced from the full ones, and 3 more EP = 2 steps must
match the unreplaced single-process AdamW (which never saw a replacement) within 1e-4: Adam
normalises each update, so rounding-level gradient differences on elements whose gradient is
near zero move them by up to ~3e-5 here, while dropping the moments (checked once by hand)
moves the weights by ~0.1 and a wrong group's learning rate by far more than 1e-4.
The pure remap is also checked without processes: a swap spread over two groups is refused.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from deepshard.autoep import ParamSwap, ReplacementReport, parallelize_experts, remap_optimizer
from deepshard.comm import ParallelDims, all_reduce
from deepshard.interface import PlacementRegistry, Topology
from deepshard.interface.errors import ConfigError
from deepshard.testing import import_beside, run_on_mesh

pytest.importorskip("transformers", reason="transformers is in the dev group only")
_tiny = import_beside(__file__, "_tiny_moe.py")


def _adamw(model: nn.Module) -> torch.optim.AdamW:
    experts = [p for n, p in model.named_parameters() if ".experts." in n or ".gate." in n]
    ids = {id(p) for p in experts}
    rest = [p for p in model.parameters() if id(p) not in ids]
    return torch.optim.AdamW(
        [{"params": experts, "lr": 2e-2, "weight_decay": 0.0}, {"params": rest, "lr": 5e-3}],
        weight_decay=0.1,
    )


def _rank(mesh: Any) -> dict[str, Any]:
    dims = ParallelDims.from_mesh(mesh)
    rank, world = dims.rank, dims.topology.world_size
    ref = _tiny.build("qwen3_moe", 4)
    model = copy.deepcopy(ref)
    ref_opt, opt = _adamw(ref), _adamw(model)
    first = [_tiny.batch(0, r) for r in range(world)]
    _tiny.reference_step(ref, ref_opt, first)
    _tiny.reference_step(model, opt, first)  # the same full step, before the replacement
    old = {id(p) for p in model.parameters()}
    report = parallelize_experts(model, dims, optimizer=opt)
    in_groups = [{id(p) for p in g["params"]} for g in opt.param_groups]
    names = {id(p): n for n, p in model.named_parameters()}
    result: dict[str, Any] = {
        "stale_in_groups": sum(id(p) in ids for p in report.discarded for ids in in_groups),
        "stale_in_state": sum(p in opt.state for p in report.discarded),
        "expert_groups": sorted(
            {i for s in report.swaps for i, ids in enumerate(in_groups) if id(s.new) in ids}
        ),
        "all_in_optimizer": set(names) == set().union(*in_groups),
        "moment_shapes": [tuple(opt.state[s.new]["exp_avg"].shape) for s in report.swaps],
        "local_shapes": [tuple(s.new.shape) for s in report.swaps],
        "new_params": sum(id(p) not in old for p in model.parameters()),
    }
    for step in range(1, 4):
        loss = _tiny.loss_of(model, _tiny.batch(step, rank))
        loss.backward()
        for name, param in model.named_parameters():
            group = dims.group_over(report.placements[name].reduce_over)
            all_reduce(param.grad, group=group, op="avg").wait()
        opt.step()
        opt.zero_grad(set_to_none=True)
        _tiny.reference_step(ref, ref_opt, [_tiny.batch(step, r) for r in range(world)])
    reference = dict(ref.named_parameters())
    diff = 0.0
    for name, param in model.named_parameters():
        expected = reference[name].detach()
        if name in report.shard_maps:
            lo, hi = report.blocks[0].local_experts
            expected = expected[lo:hi]
        diff = max(diff, float((param.detach() - expected).abs().max()))
    result["weight_diff"] = diff
    return result


@pytest.mark.timeout(400)
def test_adamw_built_first_trains_the_new_experts_in_their_group(tmp_path: Path) -> None:
    results = run_on_mesh(_rank, 2, topology=Topology(ep=2), store_dir=tmp_path, timeout_s=360)
    for res in results:
        assert res["stale_in_groups"] == 0 and res["stale_in_state"] == 0
        assert res["expert_groups"] == [0] and res["all_in_optimizer"]
        assert res["new_params"] == 4  # gate_up and down of 2 layers
        assert res["moment_shapes"] == res["local_shapes"]
        assert res["local_shapes"][0][0] == 2  # 4 experts over 2 ranks
        assert res["weight_diff"] < 1e-4, res["weight_diff"]


def test_a_swap_whose_sources_span_two_groups_is_refused() -> None:
    a, b = nn.Parameter(torch.ones(2, 3)), nn.Parameter(torch.ones(2, 3))
    new = nn.Parameter(torch.ones(1, 3))
    opt = torch.optim.SGD([{"params": [a]}, {"params": [b], "lr": 0.5}], lr=0.1)
    swap = ParamSwap("x", new, (a, b), lambda ts: ts[0][:1])
    report = ReplacementReport((), PlacementRegistry(Topology()), {}, (swap,))
    with pytest.raises(ConfigError, match=r"param groups \[0, 1\]"):
        remap_optimizer(opt, report)
