"""Partial optimizer offload at ZeRO stage 3 (``offload_optimizer.ratio`` < 1) trains like one
process and like stage 3, with the sub-groups where DeepSpeed puts them.

One 2-rank run trains the odd-sized MLP (`_training`: torch's AdamW over two param groups, an
LR schedule, clipping), each ``Linear`` a unit and ``sub_group_size`` 100, so every rank has
several sub-groups per unit, at ratios 0.5 (fp32), 0.3 (bf16), 0.6 with 2 micro-steps and
``offload_param: cpu``, and 0.0 (everything on the device), next to plain stage 3. Every run
must match the single-process reference and plain stage 3 with the tolerances of
`test_stage_matches_reference` (the device share applies the CPU Adam kernel's formula with
torch operations, the host share is the kernel).

Where the sub-groups live, checked in each rank: of the ``n`` sub-groups (in unit order) the
first ``int((1 - ratio) · n)`` step on the device and the rest on the host; together they cover
every element of every trainable parameter this rank holds (from `shard_info`) exactly once; the
device masters are exactly ``4 ×`` the device share's elements (``master_bytes``); after
training, the host's Adam moments are still zero over every device sub-group (the host never
stepped them) and not over the host ones, while the device share's moments are not. Then the
host mirror is brought up to date by reading: ``safe_get_full_fp32_param`` of every parameter
equals the gathered fp32 parameter exactly. At ratio 0.5 ``offload_states`` releases the device
share's masters too, and after ``reload_states`` the state dict saved then and loaded into a
fresh run continues bit-identically with the reloaded run for one more step.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from deepshard.testing import import_beside, run_on_mesh

_training = import_beside(__file__, "_training.py")
_reference_test = import_beside(__file__, "test_stage_matches_reference.py")
_offload_test = import_beside(__file__, "test_stage3_offload_matches_reference.py")

WORLD = 2
F32, BF16 = torch.float32, torch.bfloat16
RUNS = [(0.5, F32, 1, "none"), (0.3, BF16, 1, "none"), (0.6, F32, 2, "cpu"), (0.0, F32, 1, "none")]
PLAIN = [("none", "none", F32, 1), ("none", "none", BF16, 1), ("none", "none", F32, 2)]


def _build(group: Any, run: tuple[float, torch.dtype, int, str]) -> tuple[Any, Any, Any]:
    from deepshard.interface.config import ZeroConfig
    from deepshard.zero import ZeroOptimizer, ZeroPolicy, shard

    ratio, dtype, _, par = run
    config = ZeroConfig(
        stage=3,
        sub_group_size=100,
        offload_optimizer={"device": "cpu", "ratio": ratio},
        offload_param={"device": "cpu"} if par == "cpu" else None,
    )
    model = _training.make_model(dtype)
    inner = torch.optim.AdamW(_training.param_groups(list(model.parameters())), lr=_training.LR)
    offload = ZeroPolicy.from_config(config).param_offload
    policy = ZeroPolicy(unit_classes=(torch.nn.Linear,), param_offload=offload,
                        **_offload_test.EAGER)  # fmt: skip
    sharded = shard(model, group=group, policy=policy)
    zero = ZeroOptimizer(inner, sharded, config=config, gradient_clipping=_training.CLIP)
    return model, sharded, zero


def _where(model: Any, sharded: Any, zero: Any, ratio: float) -> dict[str, Any]:
    """Where the sub-groups live (read before anything refreshes the host mirror)."""
    placement = zero._offload.placement()
    kinds = [where for _, where in placement]
    device = [sub for sub, where in placement if where == "device"]
    covered: dict[int, list[int]] = {}
    for sub, _ in placement:
        covered.setdefault(sub.group, []).extend(range(sub.start, sub.stop))
    wanted: dict[int, list[int]] = {}
    for param in model.parameters():
        info = sharded.shard_info(param)
        lo = info.local_offset
        wanted.setdefault(info.unit, []).extend(range(lo, lo + info.local_numel))
    host_moments = zero._offload.state.moments[0]
    share = zero._offload.device_share
    return {
        "split": kinds == ["device"] * len(device) + ["host"] * (len(kinds) - len(device))
        and len(device) == int((1 - ratio) * len(kinds)),
        "several": len(kinds) > 4,
        "covered": all(sorted(covered.get(u, [])) == sorted(v) for u, v in wanted.items())
        and sum(len(v) for v in covered.values()) == sum(len(v) for v in wanted.values()),
        "master_bytes": (zero.master_bytes(), 4 * sum(s.numel for s in device)),
        "host_untouched": all(
            not host_moments[s.group][s.start : s.stop].any() for s in device
        ),
        "host_stepped": all(
            host_moments[s.group][s.start : s.stop].any()
            for s, where in placement if where == "host"
        ),
        "device_stepped": share is None or all(m.any() for m in share.moments[0]),
    }  # fmt: skip


def _exact_reads(model: Any, sharded: Any, zero: Any) -> bool:
    import deepshard.zero as dz

    reads = [dz.safe_get_full_fp32_param(p, zero) for p in model.parameters()]
    with sharded.gathered():
        return all(torch.equal(r, p.detach().float()) for r, p in zip(reads, model.parameters(),
                                                                       strict=True))  # fmt: skip


def _one_more_step(model: Any, sharded: Any, zero: Any, rank: int) -> list[torch.Tensor]:
    x, y = _training.batch(_training.STEPS)
    mb = _training.GLOBAL_BATCH // WORLD
    zero.backward(_training.loss_fn(model, x[rank * mb : (rank + 1) * mb],
                                    y[rank * mb : (rank + 1) * mb]))  # fmt: skip
    zero.step()
    with sharded.gathered():
        return [p.detach().clone() for p in model.parameters()]


def _train_all(mesh: Any, root: str) -> dict[Any, Any]:
    group, rank = mesh["dp"], mesh.get_rank()
    results: dict[Any, Any] = {}
    for run in PLAIN:
        model, sharded, zero = _offload_test._build(group, run, root)
        results[run] = _offload_test._train(model, sharded, zero, rank, run[3])
        with sharded.gathered():
            results[run]["params"] = [p.detach().float().clone() for p in model.parameters()]
        zero.close()
    for run in RUNS:
        model, sharded, zero = _build(group, run)
        result = _offload_test._train(model, sharded, zero, rank, run[2])
        result["where"] = _where(model, sharded, zero, run[0])
        result["exact_reads"] = _exact_reads(model, sharded, zero) if run[1] == F32 else True
        with sharded.gathered():
            result["params"] = [p.detach().float().clone() for p in model.parameters()]
        if run[0] == 0.5:  # offload_states moves the device share too, and back bit-exactly
            zero.offload_states()
            share = zero._offload.device_share
            result["offloaded"] = [m.untyped_storage().nbytes() for m in share.masters]
            zero.reload_states()
            saved = zero.state_dict()
            again, sharded2, zero2 = _build(group, run)
            zero2.load_state_dict(saved)
            result["resumed"] = (_one_more_step(model, sharded, zero, rank),
                                 _one_more_step(again, sharded2, zero2, rank))  # fmt: skip
            zero2.close()
        zero.close()
        results[run] = result
    return results


def test_partial_offload_splits_sub_groups_and_matches_reference(tmp_path: Path) -> None:
    root = tmp_path / "nvme"
    root.mkdir()
    per_rank = run_on_mesh(_train_all, WORLD, args=(str(root),), store_dir=tmp_path, timeout_s=240)
    refs = {dtype: _training.reference(dtype) for dtype in (F32, BF16)}
    for run in RUNS:
        ratio, dtype, ga, _ = run
        merged = _offload_test._merged(per_rank, run)
        plain = _offload_test._merged(per_rank, ("none", "none", dtype, ga))
        init = _training.initial_params(dtype)
        _reference_test._check(merged, refs[dtype], dtype, init)
        _reference_test._check(merged, plain, dtype, init)
        for rank_results in per_rank:
            where = rank_results[run]["where"]
            assert where["split"] and where["several"] and where["covered"], run
            got, wanted = where["master_bytes"]
            assert got == wanted and (wanted > 0) == (ratio < 1), run
            assert where["host_untouched"] and where["host_stepped"], run
            assert where["device_stepped"], run
            assert rank_results[run]["exact_reads"], run
            if ratio == 0.5:
                assert set(rank_results[run]["offloaded"]) == {0}
                continued, resumed = rank_results[run]["resumed"]
                assert all(torch.equal(a, b) for a, b in zip(continued, resumed, strict=True))
