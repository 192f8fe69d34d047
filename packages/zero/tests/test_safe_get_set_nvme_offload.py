"""``safe_get_*`` / ``safe_set_*`` of fp32 masters and Adam moments with optimizer offload, stages
1-3: with ``device: "nvme"`` they read and write the swap files.

One 2-rank run trains the odd-sized MLP (AdamW over two param groups, clipping) at stages 1, 2
and 3 (each ``Linear`` a unit), each without offload (torch's AdamW on the device), with
``offload_optimizer: cpu`` (host buffers, read in place) and with ``nvme`` (files;
``sub_group_size`` 100 cuts each partition into several sub-groups, so the ranges below cross
sub-group boundaries). The same sequence in every run:

1. before the first step (offload runs only: torch's AdamW has no state yet), ``exp_avg`` of the
   last weight reads as zeros; each rank sets its local piece to a rank-specific value (with
   NVMe: moments of sub-groups never stepped, which the files do not hold yet) and reads the
   whole back, then sets it back to zeros, so training is unchanged;
2. two steps, then the full fp32 master, ``exp_avg`` and ``exp_avg_sq`` of every parameter;
3. the first weight's master set whole, the second weight's ``exp_avg`` set whole, and every
   rank doubling its own piece of the last weight's master (``safe_set_local_fp32_param``),
   each read back; one more step and the final parameters.

The cpu and nvme runs step with the same CPU Adam kernel on the same values, so everything they
return must be identical; both must match the run without offload (a different Adam
implementation: 1e-5 relative), which reads the device masters and torch's state. Set values
read back exactly.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from deepshard.testing import import_beside, run_on_mesh

_training = import_beside(__file__, "_training.py")

WORLD, STAGES, OFFLOADS = 2, (1, 2, 3), ("none", "cpu", "nvme")


def _value(shape: tuple[int, ...], scale: float) -> torch.Tensor:
    return torch.linspace(-scale, scale, int(torch.Size(shape).numel())).view(shape)


def _build(group: Any, stage: int, offload: str, root: str) -> tuple[Any, Any, Any]:
    from deepshard.interface.config import ZeroConfig
    from deepshard.zero import ZeroOptimizer, ZeroPolicy, shard

    sections = {
        "none": None,
        "cpu": {"device": "cpu"},
        "nvme": {"device": "nvme", "nvme_path": root, "pipeline_read": True, "buffer_count": 6},
    }
    config = ZeroConfig(stage=stage, sub_group_size=100, offload_optimizer=sections[offload])
    model = _training.make_model()
    inner = torch.optim.AdamW(_training.param_groups(list(model.parameters())), lr=_training.LR)
    if stage < 3:
        zero = ZeroOptimizer(inner, group=group, config=config, gradient_clipping=_training.CLIP,
                             named_parameters=model.named_parameters())  # fmt: skip
        return model, zero, None
    policy = ZeroPolicy(unit_classes=(torch.nn.Linear,), param_persistence_threshold=0)
    sharded = shard(model, group=group, policy=policy)
    zero = ZeroOptimizer(inner, sharded, config=config, gradient_clipping=_training.CLIP)
    return model, zero, sharded


def _shape(param: torch.Tensor, sharded: Any) -> tuple[int, ...]:
    return tuple(param.shape) if sharded is None else tuple(sharded.shard_info(param).shape)


def _fresh_moments(model: Any, zero: Any, sharded: Any, rank: int) -> dict[str, Any]:
    import deepshard.zero as dz

    last = model[4].weight
    before = dz.safe_get_full_optimizer_state(last, zero, "exp_avg")
    local = dz.safe_get_local_optimizer_state(last, zero, "exp_avg")
    mine = torch.full_like(local, float(rank + 1))
    dz.safe_set_local_optimizer_state(last, zero, mine, "exp_avg")
    after = dz.safe_get_full_optimizer_state(last, zero, "exp_avg")
    dz.safe_set_full_optimizer_state(last, zero, torch.zeros(_shape(last, sharded)), "exp_avg")
    spans = [(p.flat_start, p.stop) for p in zero.param_shard_map(last).pieces_of(rank)]
    return {"before": before, "after": after, "spans": spans, "local_numel": local.numel()}


def _run(group: Any, rank: int, stage: int, offload: str, root: str) -> dict[str, Any]:
    import deepshard.zero as dz

    model, zero, sharded = _build(group, stage, offload, root)
    params = list(model.parameters())
    out: dict[str, Any] = {}
    if offload != "none":
        out["fresh"] = _fresh_moments(model, zero, sharded, rank)
    mb = _training.GLOBAL_BATCH // WORLD
    for step in range(3):
        if step == 2:
            out["read"] = {
                key: [dz.safe_get_full_optimizer_state(p, zero, key) for p in params]
                for key in ("exp_avg", "exp_avg_sq")
            }
            out["read"]["fp32"] = [dz.safe_get_full_fp32_param(p, zero) for p in params]
            out["set"] = _set(model, zero, sharded)
        x, y = _training.batch(step)
        rows = slice(rank * mb, (rank + 1) * mb)
        zero.backward(_training.loss_fn(model, x[rows], y[rows]))
        zero.step()
    out["final"] = [dz.safe_get_full_fp32_param(p, zero) for p in params]
    zero.close()
    return out


def _set(model: Any, zero: Any, sharded: Any) -> dict[str, torch.Tensor]:
    import deepshard.zero as dz

    first, second, last = model[0].weight, model[2].weight, model[4].weight
    dz.safe_set_full_fp32_param(first, zero, _value(_shape(first, sharded), 0.3))
    dz.safe_set_full_optimizer_state(second, zero, _value(_shape(second, sharded), 0.01), "exp_avg")
    doubled = 2 * dz.safe_get_local_fp32_param(last, zero)
    dz.safe_set_local_fp32_param(last, zero, doubled)
    return {
        "first": dz.safe_get_full_fp32_param(first, zero),
        "second": dz.safe_get_full_optimizer_state(second, zero, "exp_avg"),
        "last_local": (dz.safe_get_local_fp32_param(last, zero), doubled),
        "last": dz.safe_get_full_fp32_param(last, zero),
    }


def _all(mesh: Any, root: str) -> dict[Any, Any]:
    group, rank = mesh["dp"].get_group(), mesh.get_rank()
    out: dict[Any, Any] = {}
    for stage in STAGES:
        for offload in OFFLOADS:
            path = Path(root) / f"rank{rank}-{stage}-{offload}"
            path.mkdir(parents=True)
            out[stage, offload] = _run(group, rank, stage, offload, str(path))
    return out


def _close(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_safe_get_and_set_through_nvme_files_at_stages_1_to_3(tmp_path: Path) -> None:
    root = tmp_path / "swap"
    per_rank = run_on_mesh(_all, WORLD, args=(str(root),), store_dir=tmp_path, timeout_s=240)
    for stage in STAGES:
        plain, cpu, nvme = (per_rank[0][stage, o] for o in OFFLOADS)
        for rank_results in per_rank:  # both ranks read the same whole tensors
            for o in OFFLOADS:
                mine, first = rank_results[stage, o]["final"], per_rank[0][stage, o]["final"]
                assert all(torch.equal(a, b) for a, b in zip(mine, first, strict=True))
        # cpu (host buffers, in place) and nvme (files) run the same kernel: identical
        for key in ("fp32", "exp_avg", "exp_avg_sq"):
            assert all(
                torch.equal(a, b) for a, b in zip(cpu["read"][key], nvme["read"][key], strict=True)
            )
            _close(nvme["read"][key], plain["read"][key])
        assert all(torch.equal(a, b) for a, b in zip(cpu["final"], nvme["final"], strict=True))
        _close(nvme["final"], plain["final"])
        first = _value(tuple(plain["read"]["fp32"][0].shape), 0.3)
        second = _value(tuple(plain["read"]["fp32"][2].shape), 0.01)
        for run in (plain, cpu, nvme):
            assert torch.equal(run["set"]["first"], first)
            assert torch.equal(run["set"]["second"], second)
            got_local, doubled = run["set"]["last_local"]
            assert torch.equal(got_local, doubled)
            assert torch.equal(run["set"]["last"], 2 * run["read"]["fp32"][4])
        for o in ("cpu", "nvme"):
            covered = 0
            for rank_results in per_rank:
                fresh = rank_results[stage, o]["fresh"]
                assert torch.equal(fresh["before"], torch.zeros_like(fresh["before"]))
                flat = fresh["after"].reshape(-1)
                assert sum(b - a for a, b in fresh["spans"]) == fresh["local_numel"]
                # every rank's pieces carry the rank + 1 it set, read back whole on each rank
                for other, other_results in enumerate(per_rank):
                    for a, b in other_results[stage, o]["fresh"]["spans"]:
                        assert torch.equal(flat[a:b], torch.full((b - a,), other + 1.0))
                covered += fresh["local_numel"]
            assert covered == flat.numel(), (stage, o)
