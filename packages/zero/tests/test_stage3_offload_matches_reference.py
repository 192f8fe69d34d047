"""ZeRO stage 3 with optimizer and parameter offload trains like one process and like stage 3.

One 2-rank run trains the odd-sized MLP (`_training`, each ``Linear`` a unit, so every unit's
parameters straddle the rank boundary) with torch's AdamW over two param groups (they cut
across units), an LR scheduler and clipping, for a covering set of (offload_optimizer ×
offload_param × dtype) next to stage 3 without offload. The eager policy (no reuse, no
persistence) re-gathers every unit for every forward and backward, so each gather goes through
the parameter home (host copy, file read). ``sub_group_size`` 100 cuts each unit's ranges into
several sub-groups (the unit of the host pipeline); one fp32 run accumulates over 2 micro-steps.

Tolerances are those of `test_stage_matches_reference` against the reference and against the
run without offload: the host step is DeepShard's CPU Adam kernel (the same formula as torch's
AdamW, ``sqrt`` in fp64). Parameter offload alone (the step on the device) is the same
arithmetic as plain stage 3, so it must match it bit for bit.

Where things live after training, found without the implementation's own bookkeeping where it
can be: with ``offload_optimizer: cpu`` the masters are host buffers separate from the
partitions (except that an fp32 host partition, ``offload_param: cpu``, is its own master: the
same storage) and the device holds no master; with ``nvme`` the master and moment files have
4 bytes per element up to the last trainable element of the unit this rank holds (computed
from `shard_info`). With ``offload_param: cpu`` the device holds no partition bytes; with
``nvme`` every partition tensor holds no bytes and each unit's file holds exactly this rank's
slice of the gathered parameters.
"""

from __future__ import annotations

import gc
import os
from pathlib import Path
from typing import Any

import torch

from deepshard.testing import import_beside, run_on_mesh

_training = import_beside(__file__, "_training.py")
_reference_test = import_beside(__file__, "test_stage_matches_reference.py")

WORLD = 2
EAGER = {"max_reuse_distance": 0, "param_persistence_threshold": 0, "prefetch_bucket_size": 600}
F32, BF16 = torch.float32, torch.bfloat16
# (optimizer offload, parameter offload, dtype, accumulation steps)
RUNS = [
    ("none", "none", F32, 1),
    ("none", "none", F32, 2),
    ("none", "none", BF16, 1),
    ("cpu", "none", F32, 1),
    ("nvme", "none", BF16, 1),
    ("none", "cpu", F32, 1),
    ("none", "nvme", F32, 2),
    ("cpu", "cpu", BF16, 1),
    ("cpu", "cpu", F32, 1),
    ("cpu", "nvme", F32, 2),
    ("nvme", "cpu", F32, 1),
    ("nvme", "nvme", BF16, 1),
]


def _section(device: str, root: str, **extra: Any) -> dict[str, Any] | None:
    if device == "none":
        return None
    if device == "cpu":
        return {"device": "cpu", "pin_memory": True}
    return {"device": "nvme", "nvme_path": root, **extra}


def _build(group: Any, run: tuple[str, str, torch.dtype, int], root: str) -> tuple[Any, ...]:
    from deepshard.interface.config import ZeroConfig
    from deepshard.zero import ZeroOptimizer, ZeroPolicy, shard

    opt, par, dtype, _ = run
    pipelined = {"pipeline_read": True, "pipeline_write": True, "buffer_count": 9}
    config = ZeroConfig(
        stage=3,
        sub_group_size=100,
        offload_optimizer=_section(opt, root, **pipelined),
        offload_param=_section(par, root, buffer_count=2, buffer_size=1000),
    )
    model = _training.make_model(dtype)
    inner = torch.optim.AdamW(_training.param_groups(list(model.parameters())), lr=_training.LR)
    base = ZeroPolicy.from_config(config)
    policy = ZeroPolicy(unit_classes=(torch.nn.Linear,), param_offload=base.param_offload, **EAGER)
    sharded = shard(model, group=group, policy=policy)
    zero = ZeroOptimizer(inner, sharded, config=config, gradient_clipping=_training.CLIP)
    return model, sharded, zero


def _train(model: Any, sharded: Any, zero: Any, rank: int, ga: int) -> dict[str, Any]:
    scheduler = torch.optim.lr_scheduler.LambdaLR(zero, _training.lr_factor)
    mb = _training.GLOBAL_BATCH // (WORLD * ga)
    losses, norms = [], []
    for step in range(_training.STEPS):
        x, y = _training.batch(step)
        total = 0.0
        for m in range(ga):
            rows = slice((m * WORLD + rank) * mb, (m * WORLD + rank + 1) * mb)
            loss = _training.loss_fn(model, x[rows], y[rows]) / ga
            zero.backward(loss, is_boundary=m == ga - 1)
            total += loss.item()
        result = zero.step()
        scheduler.step()
        losses.append(total)
        norms.append(result.grad_norm)
    return {"losses": losses, "norms": norms}


def _file_bytes(path: Path, dtype: torch.dtype) -> torch.Tensor:
    data = Path(path).read_bytes()  # torch.frombuffer refuses an empty buffer
    if not data:
        return torch.empty(0, dtype=dtype)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype)


def _where(model: Any, sharded: Any, zero: Any, run: tuple[str, str, torch.dtype, int]) -> dict:
    """Where the state lives after training (checked in the rank, returned as facts)."""
    opt, par, dtype, _ = run
    facts: dict[str, Any] = {"master_bytes": zero.master_bytes()}
    facts["partition_bytes"] = sharded.partition_bytes()
    units = sharded.units
    last = {u.plan.index: 0 for u in units}
    for param in model.parameters():
        info = sharded.shard_info(param)
        if info.local_numel:
            last[info.unit] = max(last[info.unit], info.local_offset + info.local_numel)
    if opt == "cpu":
        masters = zero.master_partitions
        facts["masters_shared"] = [
            m.untyped_storage().data_ptr() == u.partition.untyped_storage().data_ptr()
            for m, u in zip(masters, units, strict=True)
            if u.plan.params  # the root owns nothing: no storage to compare
        ]
    if opt == "nvme":
        state = zero._offload.state
        sizes, wanted = [], []
        for u in (u for u in units if u.plan.params):
            for name in ("master", "exp_avg", "exp_avg_sq"):
                path = state.file(u.plan.index, name)
                sizes.append(path.stat().st_size if path.exists() else 0)
                wanted.append(4 * last[u.plan.index])
        facts["optimizer_files"] = (sizes, wanted)
    if par == "nvme":
        facts["partition_storage"] = [u.partition.untyped_storage().nbytes() for u in units]
        files = [_file_bytes(u.home.file, dtype) for u in units]
        with sharded.gathered():
            slices = []
            for u in units:
                chunk = u.plan.layout.partition_numel
                slices.append(u.buffer[u.rank * chunk : (u.rank + 1) * chunk].clone())
        facts["param_files"] = all(torch.equal(f, s) for f, s in zip(files, slices, strict=True))
    return facts


def _train_all(mesh: Any, root: str) -> dict[Any, Any]:
    group, rank = mesh["dp"], mesh.get_rank()
    results: dict[Any, Any] = {}
    for run in RUNS:
        model, sharded, zero = _build(group, run, root)
        result = _train(model, sharded, zero, rank, run[3])
        result["where"] = _where(model, sharded, zero, run)
        with sharded.gathered():
            result["params"] = [p.detach().float().clone() for p in model.parameters()]
        zero.close()
        results[run] = result
    gc.collect()
    results["left"] = sorted(p.name for p in Path(root).glob(f"zero3*pid{os.getpid()}-*"))
    return results


def _merged(per_rank: list[dict[Any, Any]], key: Any) -> dict[str, Any]:
    results = [r[key] for r in per_rank]
    for other in results[1:]:
        for a, b in zip(other["params"], results[0]["params"], strict=True):
            assert torch.equal(a, b), f"ranks disagree for {key}"
    steps = len(results[0]["losses"])
    losses = [sum(r["losses"][i] for r in results) / len(results) for i in range(steps)]
    return {"losses": losses, "norms": results[0]["norms"], "params": results[0]["params"]}


def test_stage3_offload_matches_reference_and_plain_stage3(tmp_path: Path) -> None:
    root = tmp_path / "nvme"
    root.mkdir()
    per_rank = run_on_mesh(_train_all, WORLD, args=(str(root),), store_dir=tmp_path, timeout_s=240)
    refs = {dtype: _training.reference(dtype) for dtype in (F32, BF16)}
    for run in RUNS:
        opt, par, dtype, ga = run
        merged = _merged(per_rank, run)
        init = _training.initial_params(dtype)
        plain = _merged(per_rank, ("none", "none", dtype, ga if dtype == F32 else 1))
        _reference_test._check(merged, refs[dtype], dtype, init)
        _reference_test._check(merged, plain, dtype, init)
        if opt == "none":  # the step runs on the device either way: the same arithmetic
            assert merged["losses"] == plain["losses"], run
            for a, b in zip(merged["params"], plain["params"], strict=True):
                assert torch.equal(a, b), run
        for rank_results in per_rank:
            where = rank_results[run]["where"]
            if opt != "none":
                assert where["master_bytes"] == 0, run  # no master on the device
            if opt == "cpu":  # an fp32 host partition is its own master; else a copy
                shared = where["masters_shared"]
                assert shared == [par == "cpu" and dtype == F32] * len(shared), run
            if opt == "nvme":
                sizes, wanted = where["optimizer_files"]
                assert sizes == wanted and min(wanted) > 0, run
            if par != "none":
                assert where["partition_bytes"] == 0, run
            if par == "nvme":
                assert where["partition_storage"] == [0] * len(where["partition_storage"]), run
                assert where["param_files"], run
    assert [r["left"] for r in per_rank] == [[], []]
    assert list(root.iterdir()) == []
