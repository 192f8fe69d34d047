"""Optimizer offload at stages 1-2 trains like the run without it and like one process.

One 2-rank run trains the odd-sized MLP (`_training`) for `_training.STEPS` steps with torch's
AdamW, two param groups, an LR scheduler on the wrapper and clipping, for stage 1 and 2 ×
offload to ``cpu`` and ``nvme`` × fp32/bf16, each next to the same run without offload. With
``sub_group_size`` 256 the first group's partition (about 880 elements per rank) is stepped in 4
sub-groups and the second in 1, so the copy/read-ahead/write-behind pipeline runs over 5
sub-groups; stage 2 accumulates over 2 micro-steps, and its NVMe runs read ahead and write
behind (``pipeline_read``/``pipeline_write``) while stage 1's wait for every request.

Tolerances are those of `test_stage_matches_reference` (fp32 1e-5 relative; bf16 2u on losses
and norms and 10 % of the distance moved for parameters), against the reference and against the
run without offload: the host step is DeepShard's CPU Adam kernel, the same formula as torch's
AdamW in another order (it takes ``sqrt`` in fp64). An optimizer other than Adam (torch SGD with
momentum) is stepped itself on the host masters, which is the same arithmetic as without
offload: equal bit for bit. The swap directories are gone once the optimizers are collected.
"""

from __future__ import annotations

import gc
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from deepshard.testing import import_beside, run_on_mesh

_training = import_beside(__file__, "_training.py")
_reference_test = import_beside(__file__, "test_stage_matches_reference.py")

WORLD = 2
SUB_GROUP = 256
RUNS = [
    (stage, device, dtype)
    for stage in (1, 2)
    for device in ("cpu", "nvme")
    for dtype in (torch.float32, torch.bfloat16)
]


def _offload(stage: int, device: str, root: str) -> dict[str, Any]:
    if device == "cpu":
        return {"device": "cpu", "pin_memory": True}
    pipelined = stage == 2
    return {
        "device": "nvme",
        "nvme_path": root,
        "pipeline_read": pipelined,
        "pipeline_write": pipelined,
        "buffer_count": 9 if pipelined else 4,
    }


def _sgd(groups: list[dict[str, Any]], lr: float) -> torch.optim.Optimizer:
    return torch.optim.SGD(groups, lr=lr, momentum=0.9)


def _train_all(mesh: Any, root: str) -> dict[Any, Any]:
    group, rank = mesh["dp"], mesh.get_rank()
    results: dict[Any, Any] = {}
    for stage in (1, 2):
        ga = stage  # stage 2 accumulates over two micro-steps
        for dtype in (torch.float32, torch.bfloat16):
            results[(stage, "none", dtype)] = _training.train_zero(
                group, rank, WORLD, stage=stage, ga=ga, dtype=dtype
            )
    for stage, device, dtype in RUNS:
        kept: list[Any] = []
        config = {"sub_group_size": SUB_GROUP, "offload_optimizer": _offload(stage, device, root)}
        result = _training.train_zero(
            group, rank, WORLD, stage=stage, ga=stage, dtype=dtype, config_kwargs=config, keep=kept
        )
        result["sub_groups"] = len(kept.pop()._offload.sub_groups)
        results[(stage, device, dtype)] = result
    for offload in (None, {"device": "cpu"}):
        config = {"offload_optimizer": offload, "sub_group_size": SUB_GROUP}
        results[("sgd", offload is not None)] = _training.train_zero(
            group, rank, WORLD, stage=2, ga=1, dtype=torch.float32, config_kwargs=config,
            inner_factory=_sgd, zero_kwargs={"zero_force_ds_cpu_optimizer": False},
        )  # fmt: skip
    gc.collect()  # the optimizers are garbage: their finalizers remove the swap directories
    results["left"] = sorted(p.name for p in Path(root).glob(f"zero-pid{os.getpid()}-*"))
    return results


def _merged(per_rank: list[dict[Any, Any]], key: Any) -> dict[str, Any]:
    results = [r[key] for r in per_rank]
    for other in results[1:]:
        for a, b in zip(other["params"], results[0]["params"], strict=True):
            assert torch.equal(a, b), f"ranks disagree for {key}"
    steps = len(results[0]["losses"])
    losses = [sum(r["losses"][i] for r in results) / len(results) for i in range(steps)]
    return {"losses": losses, "norms": results[0]["norms"], "params": results[0]["params"]}


@pytest.mark.slow
def test_offload_matches_reference_and_the_run_without_it(tmp_path: Path) -> None:
    root = tmp_path / "nvme"
    root.mkdir()
    per_rank = run_on_mesh(_train_all, WORLD, args=(str(root),), store_dir=tmp_path, timeout_s=240)
    references = {dtype: _training.reference(dtype) for dtype in (torch.float32, torch.bfloat16)}
    for stage, device, dtype in RUNS:
        assert all(r[(stage, device, dtype)]["sub_groups"] == 5 for r in per_rank)
        merged = _merged(per_rank, (stage, device, dtype))
        init = _training.initial_params(dtype)
        _reference_test._check(merged, references[dtype], dtype, init)
        _reference_test._check(merged, _merged(per_rank, (stage, "none", dtype)), dtype, init)
    plain, offloaded = _merged(per_rank, ("sgd", False)), _merged(per_rank, ("sgd", True))
    assert offloaded["losses"] == plain["losses"]
    for a, b in zip(offloaded["params"], plain["params"], strict=True):
        assert torch.equal(a, b)
    assert [r["left"] for r in per_rank] == [[], []]
    assert list(root.iterdir()) == []
