"""`deepshard.zero.Init` with NVMe parameter offload: the slices are in files from construction on.

One 2-rank ``run_on_mesh`` call:

* **Construction.** The 16-layer wide MLP of `test_init_builds_partitioned` is built under
  ``Init`` whose policy offloads parameters to NVMe, under that test's ``LiveBytes`` count of
  live storage bytes (the build, then the exit). Inside the open block: no slice bytes are in memory
  (``init.partition_bytes() == 0``), the block's swap directory holds one file per parameter of
  ``ceil(numel / W)`` fp32 elements, and each file holds exactly this rank's slice of the same
  model built whole (seed 1). The peak of the build and that of the exit each stay within
  ``3 × largest layer``, below even ``full / W`` (the in-memory build's bound is ``full / W +
  3 × largest``): finished slices never sit in memory. After the exit every unit's partition
  tensor holds no bytes, each unit's file holds this rank's chunk of the gathered parameters,
  and the block's own directory is gone.
* **Training.** The odd-sized MLP built under ``Init`` with NVMe parameter offload, with each
  optimizer offload (none, cpu, nvme) and fp32/bf16, trains like one process
  (`test_stage_matches_reference._check`) and, where the step runs on the device, bit for bit
  like plain stage 3 of the model sharded after building (`test_stage3_offload_matches_reference`
  builds and trains it here).
* ``Init(remote_device="nvme")`` without an NVMe ``offload_param`` is a ``ConfigError`` naming
  the argument and the key.
"""

from __future__ import annotations

import gc
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from deepshard.interface.errors import ConfigError
from deepshard.testing import import_beside, run_on_mesh

_training = import_beside(__file__, "_training.py")
_reference_test = import_beside(__file__, "test_stage_matches_reference.py")
_offload_test = import_beside(__file__, "test_stage3_offload_matches_reference.py")
_init_test = import_beside(__file__, "test_init_builds_partitioned.py")

WORLD = 2
F32, BF16 = torch.float32, torch.bfloat16
# (optimizer offload, parameter offload, dtype, accumulation steps); all built under Init
RUNS = [
    ("none", "nvme", F32, 1),
    ("none", "nvme", BF16, 1),
    ("cpu", "nvme", F32, 2),
    ("nvme", "nvme", BF16, 1),
]
PLAIN = [("none", "none", F32, 1), ("none", "none", BF16, 1), ("none", "none", F32, 2)]


def _policy(root: str, **knobs: Any) -> Any:
    from deepshard.interface.config import ZeroConfig
    from deepshard.zero import ZeroPolicy

    section = {"device": "nvme", "nvme_path": root, "buffer_count": 2, "buffer_size": 20_000}
    offload = ZeroPolicy.from_config(ZeroConfig(stage=3, offload_param=section)).param_offload
    return ZeroPolicy(unit_classes=(torch.nn.Linear,), param_offload=offload, **knobs)


def _file(path: Path, dtype: torch.dtype) -> torch.Tensor:
    return _offload_test._file_bytes(path, dtype)


def _construction(mesh: Any, root: str) -> dict[str, Any]:
    from deepshard.zero import GatheredParameters, Init, sharded_module_of

    rank, pid = mesh.get_rank(), os.getpid()
    whole = [p.detach().reshape(-1) for p in _init_test.wide_mlp().parameters()]
    out: dict[str, Any] = {}
    exit_count = _init_test.LiveBytes()
    with Init(mesh=mesh, policy=_policy(root, param_persistence_threshold=0)) as init:
        with _init_test.LiveBytes() as build_count:
            model = _init_test.wide_mlp()
        out["in_memory"] = init.partition_bytes()
        (directory,) = Path(root).glob(f"zero3-init-pid{pid}-*")
        files = sorted(directory.iterdir(), key=lambda f: int(f.name.removeprefix("slice")))
        slices = []
        for p in whole:
            chunk = -(-p.numel() // WORLD)
            piece = torch.zeros(chunk)
            lo, hi = min(rank * chunk, p.numel()), min((rank + 1) * chunk, p.numel())
            piece[: hi - lo] = p[lo:hi]
            slices.append(piece)
        out["slice_files"] = [
            torch.equal(_file(f, F32), s) for f, s in zip(files, slices, strict=True)
        ]
        out["file_count"] = (len(files), len(whole))
        del slices
        with GatheredParameters([model[0].weight], modifier_rank=0):  # read from, written to file
            out["gathered_whole"] = torch.equal(model[0].weight.detach().reshape(-1), whole[0])
            if rank == 0:
                model[0].weight.data.fill_(0.5)
        whole[0] = torch.full_like(whole[0], 0.5)  # rank 0's change is what every rank keeps
        exit_count.__enter__()  # the exit (units formed from the files) counted on its own
    exit_count.__exit__(None, None, None)
    out["peak"] = (build_count.peak, exit_count.peak)
    sharded = sharded_module_of(model)
    out["left_init_dirs"] = list(Path(root).glob(f"zero3-init-pid{pid}-*"))
    out["partition_storage"] = [u.partition.untyped_storage().nbytes() for u in sharded.units]
    homes = [_file(u.home.file, F32) for u in sharded.units]
    with sharded.gathered():
        chunks = []
        for u in sharded.units:
            n = u.plan.layout.partition_numel
            chunks.append(u.buffer[u.rank * n : (u.rank + 1) * n].clone())
        out["weights"] = [
            torch.equal(p, w.view_as(p)) for p, w in zip(model.parameters(), whole, strict=True)
        ]
    out["home_files"] = all(torch.equal(h, c) for h, c in zip(homes, chunks, strict=True))
    sharded.close()
    return out


def _build_under_init(mesh: Any, run: tuple[str, str, torch.dtype, int], root: str) -> Any:
    from deepshard.interface.config import ZeroConfig
    from deepshard.zero import Init, ZeroOptimizer, sharded_module_of

    opt, _, dtype, _ = run
    pipelined = {"pipeline_read": True, "pipeline_write": True, "buffer_count": 9}
    config = ZeroConfig(
        stage=3,
        sub_group_size=100,
        offload_optimizer=_offload_test._section(opt, root, **pipelined),
    )
    with Init(mesh=mesh, dtype=dtype, policy=_policy(root, **_offload_test.EAGER)):
        model = _training.make_model(F32)  # Init casts to ``dtype`` while partitioning
    sharded = sharded_module_of(model)
    # `_training.param_groups` by name: under Init a parameter's own ``dim()`` is 1 (empty)
    named = list(model.named_parameters())
    groups = [
        {"params": [p for n, p in named if n.endswith("weight")], "weight_decay": 0.1},
        {"params": [p for n, p in named if n.endswith("bias")], "weight_decay": 0.0},
    ]
    assert _training.WEIGHT_DECAY == 0.1
    inner = torch.optim.AdamW(groups, lr=_training.LR)
    zero = ZeroOptimizer(inner, sharded, config=config, gradient_clipping=_training.CLIP)
    return model, sharded, zero


def _train_all(mesh: Any, root: str) -> dict[Any, Any]:
    results: dict[Any, Any] = {"construction": _construction(mesh, root)}
    rank = mesh.get_rank()
    for run in RUNS + PLAIN:
        if run in RUNS:
            model, sharded, zero = _build_under_init(mesh, run, root)
        else:
            model, sharded, zero = _offload_test._build(mesh["dp"], run, root)
        result = _offload_test._train(model, sharded, zero, rank, run[3])
        result["storage"] = [u.partition.untyped_storage().nbytes() for u in sharded.units]
        with sharded.gathered():
            result["params"] = [p.detach().float().clone() for p in model.parameters()]
        zero.close()
        results[run] = result
    gc.collect()
    results["left"] = sorted(p.name for p in Path(root).glob(f"zero3*pid{os.getpid()}-*"))
    return results


@pytest.mark.slow
def test_init_keeps_nvme_slices_in_files_and_trains_like_reference(tmp_path: Path) -> None:
    root = tmp_path / "nvme"
    root.mkdir()
    per_rank = run_on_mesh(_train_all, WORLD, args=(str(root),), store_dir=tmp_path, timeout_s=240)
    full = sum(p.numel() * 4 for p in _init_test.wide_mlp().parameters())
    largest = (_init_test.WIDTH**2 + _init_test.WIDTH) * 4
    for r in per_rank:
        c = r["construction"]
        assert c["in_memory"] == 0
        assert c["file_count"][0] == c["file_count"][1] and all(c["slice_files"])
        assert max(c["peak"]) <= 3 * largest < full // WORLD, c["peak"]
        assert c["left_init_dirs"] == [] and set(c["partition_storage"]) == {0}
        assert all(c["weights"]) and c["home_files"] and c["gathered_whole"]
    refs = {dtype: _training.reference(dtype) for dtype in (F32, BF16)}
    for run in RUNS:
        opt, _, dtype, ga = run
        merged = _offload_test._merged(per_rank, run)
        plain = _offload_test._merged(per_rank, ("none", "none", dtype, ga))
        init = _training.initial_params(dtype)
        _reference_test._check(merged, refs[dtype], dtype, init)
        _reference_test._check(merged, plain, dtype, init)
        if opt == "none":  # the step runs on the device either way: the same arithmetic
            assert merged["losses"] == plain["losses"], run
            for a, b in zip(merged["params"], plain["params"], strict=True):
                assert torch.equal(a, b), run
        assert all(set(r[run]["storage"]) == {0} for r in per_rank), run
    assert [r["left"] for r in per_rank] == [[], []]
    assert list(root.iterdir()) == []


def _refused(mesh: Any) -> str:
    from deepshard.zero import Init

    try:
        Init(mesh=mesh, remote_device="nvme", config={"zero_optimization": {"stage": 3}})
    except ConfigError as error:
        return str(error)
    return "no error"


@pytest.mark.slow
def test_init_nvme_without_offload_param_is_refused(tmp_path: Path) -> None:
    message = run_on_mesh(_refused, 1, store_dir=tmp_path)[0]
    assert "Init(remote_device=)" in message and "offload_param" in message, message
    with pytest.raises(ConfigError, match=r"Init\(remote_device=\)"):
        from deepshard.zero import Init

        Init(remote_device="tape")
