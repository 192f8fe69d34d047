"""`parallelize_experts` on tiny HF MoE models equals the unreplaced model, forward and training.

On EP = world gloo ranks each rank replaces a copy of one seeded model and keeps only its
``E / ep`` experts (shapes asserted against ``E // ep`` computed here). Logits and the router
logits transformers records for the aux loss must equal the unreplaced model's on the rank's
own micro-batch. Then 5 plain-SGD steps, with the gradient rule written out by hand (dense
gradients averaged over every rank, expert gradients over ``dp``, read from the report's
placements), must give the same per-rank losses and, after gathering the experts over ``ep``,
the same weights as the unreplaced single-process model stepped on the mean of the per-rank
losses. DeepSeek-V3's ``e_score_correction_bias`` must still be a persistent buffer holding the
same values. DeepSeek-V2 (group-limited routing scored by each group's best expert) is checked
the same way.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch

from deepshard.autoep import ExpertParallelBlock, parallelize_experts
from deepshard.comm import ParallelDims, all_reduce
from deepshard.interface import Topology
from deepshard.testing import import_beside, run_on_mesh

# multi-rank and over ~3 s: the main run covers it, the package tox env deselects it
pytestmark = pytest.mark.slow

pytest.importorskip("transformers", reason="transformers is in the dev group only")
_tiny = import_beside(__file__, "_tiny_moe.py")

STEPS = 5


def _experts_of(family: str, ep: int) -> int:
    return 8 if family.startswith("deepseek") or ep == 4 else 4


def _hand_reduce(model: torch.nn.Module, dims: ParallelDims, placements: Any) -> None:
    for name, param in model.named_parameters():
        if param.grad is None:
            param.grad = torch.zeros_like(param)
        group = dims.group_over(placements[name].reduce_over)
        all_reduce(param.grad, group=group, op="avg").wait()


def _gathered(dims: ParallelDims, local: torch.Tensor) -> torch.Tensor:
    parts = [torch.empty_like(local) for _ in range(dims.topology.ep)]
    torch.distributed.all_gather(parts, local.contiguous(), group=dims.ep.get_group())
    return torch.cat(parts)


def _forward_checks(model: Any, ref: Any, ids: torch.Tensor) -> dict[str, float]:
    with torch.no_grad():
        out = model(input_ids=ids, output_router_logits=True)
        expected = ref(input_ids=ids, output_router_logits=True)
    result = {"logits": float((out.logits - expected.logits).abs().max())}
    if getattr(expected, "router_logits", None):
        pairs = zip(out.router_logits, expected.router_logits, strict=True)
        result["router_logits"] = max(float((a - b).abs().max()) for a, b in pairs)
    return result


def _bias_state(model: Any) -> list[tuple[str, bool, bool, list[float]]]:
    rows = []
    for module_name, module in model.named_modules():
        for name, buffer in module.named_buffers(recurse=False):
            if name == "e_score_correction_bias":
                persistent = name not in module._non_persistent_buffers_set
                rows.append((f"{module_name}.{name}", True, persistent, buffer.tolist()))
        for name, _ in module.named_parameters(recurse=False):
            if name == "e_score_correction_bias":
                rows.append((f"{module_name}.{name}", False, True, []))
    return rows


def _rank(mesh: Any, family: str) -> dict[str, Any]:
    dims = ParallelDims.from_mesh(mesh)
    ep, rank, world = dims.topology.ep, dims.rank, dims.topology.world_size
    ref = _tiny.build(family, _experts_of(family, ep))
    model = copy.deepcopy(ref)
    bias_before = _bias_state(model)
    report = parallelize_experts(model, dims)
    blocks = [m for m in model.modules() if isinstance(m, ExpertParallelBlock)]
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters() if n in report.shard_maps}
    result: dict[str, Any] = {
        "blocks": len(blocks),
        "shapes": shapes,
        "global": {n: report.placements[n].global_shape for n in shapes},
        "forward": _forward_checks(model, ref, _tiny.batch(0, rank)),
    }
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.2)
    losses, ref_losses = [], []
    for step in range(STEPS):
        loss = _tiny.loss_of(model, _tiny.batch(step, rank))
        loss.backward()
        _hand_reduce(model, dims, report.placements)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
        batches = [_tiny.batch(step, r) for r in range(world)]
        ref_losses.append(_tiny.reference_step(ref, ref_opt, batches)[rank])
    reference = dict(ref.named_parameters())
    weight_diff = 0.0
    for name, param in model.named_parameters():
        full = _gathered(dims, param.detach()) if name in report.shard_maps else param.detach()
        weight_diff = max(weight_diff, float((full - reference[name].detach()).abs().max()))
    result.update(losses=losses, ref_losses=ref_losses, weight_diff=weight_diff)
    result.update(bias_before=bias_before, bias_after=_bias_state(model))
    return result


def _check(results: list[dict[str, Any]], family: str, ep: int) -> None:
    experts = _experts_of(family, ep)
    for res in results:
        assert res["blocks"] == (1 if family.startswith("deepseek") else 2)
        assert res["shapes"], "no expert parameter was sharded"
        for name, shape in res["shapes"].items():
            assert shape[0] == experts // ep, name
            assert res["global"][name] == (experts, *shape[1:]), name
        assert res["forward"]["logits"] < 1e-5, res["forward"]
        assert res["forward"].get("router_logits", 0.0) < 1e-5, res["forward"]
        torch.testing.assert_close(res["losses"], res["ref_losses"], rtol=0, atol=1e-5)
        assert res["weight_diff"] < 1e-5, res["weight_diff"]
        assert res["bias_after"] == res["bias_before"]
    if family == "deepseek_v3":
        (name, is_buffer, persistent, values) = results[0]["bias_after"][0]
        assert is_buffer and persistent and any(v != 0.0 for v in values), name


def _families(mesh: Any, families: tuple[str, ...]) -> dict[str, dict[str, Any]]:
    # One mesh for every family: each rank imports transformers' modeling code once (tens of
    # seconds where bytecode is not cached).
    return {family: _rank(mesh, family) for family in families}


FAMILIES = ("mixtral", "qwen3_moe", "deepseek_v3", "qwen2_moe", "deepseek_v2")


@pytest.mark.timeout(600)
def test_ep2_matches_unreplaced_model(tmp_path: Path) -> None:
    results = run_on_mesh(
        _families, 2, topology=Topology(ep=2), args=(FAMILIES,), store_dir=tmp_path, timeout_s=540
    )
    for family in FAMILIES:
        _check([res[family] for res in results], family, 2)


@pytest.mark.timeout(600)
def test_ep4_mixtral_matches_unreplaced_model(tmp_path: Path) -> None:
    results = run_on_mesh(
        _families,
        4,
        topology=Topology(ep=4),
        args=(("mixtral",),),
        store_dir=tmp_path,
        timeout_s=540,
    )
    _check([res["mixtral"] for res in results], "mixtral", 4)
