"""Stage 3 on 2 ranks: exact collective bytes per step, per-rank memory, the live window, prefetch.

The MLP 13→37→29→7 with each ``Linear`` a unit. Expected numbers come from the parameter
counts: a unit of ``n`` elements is gathered as ``round_up(n, W × 4)`` fp32 elements (16-byte
alignment of each parameter inside, checked against the layout rule below).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from deepshard.testing import import_beside, run_on_mesh

_training = import_beside(__file__, "_training.py")


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _unit_numel(fan_in: int, fan_out: int, world: int) -> int:
    """Padded elements of a Linear unit: weight, then the bias at the next 4-element boundary."""
    return _round_up(_round_up(fan_in * fan_out, 4) + fan_out, world * 4)


def _setup(group: Any, **policy: Any) -> tuple[Any, Any, Any, Any]:
    from deepshard.comm import CommsLogger
    from deepshard.interface.config import CommsLoggerConfig, ZeroConfig
    from deepshard.zero import ZeroOptimizer, ZeroPolicy, shard

    logger = CommsLogger(CommsLoggerConfig(enabled=True))
    model = _training.make_model()
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
    rule = ZeroPolicy(unit_classes=(torch.nn.Linear,), **policy)
    sharded = shard(model, group=group, policy=rule, comms_logger=logger)
    zero = ZeroOptimizer(inner, sharded, config=ZeroConfig(stage=3), comms_logger=logger)
    return model, sharded, zero, logger


def _step(model: Any, zero: Any, rank: int, step: int) -> None:
    x, y = _training.batch(step)
    rows = slice(rank * 8, rank * 8 + 8)
    zero.backward(_training.loss_fn(model, x[rows], y[rows]))
    zero.step()


def _comm_and_memory(mesh: Any) -> dict[str, Any]:
    group, rank = mesh["dp"], mesh.get_rank()
    # the last unit (7·29 + 7 = 210 elements) is persistent; nothing is kept for reuse
    model, sharded, zero, logger = _setup(
        group, max_reuse_distance=0, param_persistence_threshold=250, max_live_parameters=1200
    )
    _step(model, zero, rank, 0)  # records the trace
    logger.reset()
    sharded.peak_live_numel(reset=True)
    seen: list[int] = []
    model[2].register_forward_pre_hook(lambda *_: seen.append(sharded.live_numel()))
    _step(model, zero, rank, 1)
    per_op: dict[str, list[int]] = {}
    for record in logger.records:
        per_op.setdefault(record.op, []).append(record.msg_bytes)
    x, y = _training.batch(2)
    loss = _training.loss_fn(model, x[rank * 8 : rank * 8 + 8], y[rank * 8 : rank * 8 + 8])
    zero.backward(loss)  # gradients held now, before the step consumes them
    grad_bytes = zero.gradient_bytes()
    zero.step()
    return {
        "per_op": per_op,
        "peak_live": sharded.peak_live_numel(),
        "seen_live": seen,
        "partition_bytes": sharded.partition_bytes(),
        "grad_bytes": grad_bytes,
        "state_bytes": zero.optimizer_state_bytes(),
        "master_bytes": zero.master_bytes(),
        "live_after_step": sharded.live_numel(),
    }


def _prefetch(mesh: Any, bucket: int) -> list[bool]:
    group, rank = mesh["dp"], mesh.get_rank()
    model, sharded, zero, _ = _setup(
        group, max_reuse_distance=0, param_persistence_threshold=0, prefetch_bucket_size=bucket
    )
    # runs after shard's pre-hook: has the next unit's gather been issued yet?
    ahead: list[bool] = []
    model[2].register_forward_pre_hook(lambda *_: ahead.append(sharded.is_gathered(model[4])))
    for step in range(2):
        _step(model, zero, rank, step)
    return ahead


def _all(mesh: Any) -> dict[str, Any]:
    return {
        "comm": _comm_and_memory(mesh),
        "prefetch_on": _prefetch(mesh, 50_000_000),
        "prefetch_off": _prefetch(mesh, 0),
    }


@pytest.mark.slow
def test_stage3_bytes_memory_live_window_and_prefetch(tmp_path: Path) -> None:
    world = 2
    results = run_on_mesh(_all, world, store_dir=tmp_path)
    sizes = _training.SIZES
    units = [_unit_numel(sizes[i], sizes[i + 1], world) for i in range(3)]
    persistent = units[2]
    for result in results:
        comm = result["comm"]
        gathers = comm["per_op"]["all_gather_into_tensor"]
        # forward + backward gather every non-persistent unit; the persistent one once (its
        # partition changed at the step)
        assert sorted(gathers) == sorted([4 * n for n in units[:2]] * 2 + [4 * persistent])
        assert sum(gathers) == 4 * (2 * sum(units) - persistent)
        # one reduce-scatter per unit, of the whole unit's gradient
        assert sorted(comm["per_op"]["reduce_scatter_tensor"]) == sorted(4 * n for n in units)
        assert comm["per_op"]["all_reduce"] == [16]  # the norm and the overflow flag, fp64
        # the live window (non-persistent units) never exceeds max_live_parameters
        assert 0 < comm["peak_live"] <= 1200
        assert all(0 < live <= 1200 for live in comm["seen_live"])
        assert comm["live_after_step"] == 0
        # per-rank bytes: 1/W of the model's parameters, gradients and (2×) AdamW moments
        total = sum(units)
        assert comm["partition_bytes"] == 4 * total // world
        assert comm["grad_bytes"] == 4 * total // world
        assert comm["master_bytes"] == 0  # fp32 partitions are their own masters
        steps = 4 * 4  # AdamW's step counters: one 0-d fp32 tensor per master view (≤ 4)
        assert comm["state_bytes"] <= 2 * 4 * total // world + steps
    # the moments of the ranks together cover every parameter element once (padding aside)
    real = sum(sizes[i] * sizes[i + 1] + sizes[i + 1] for i in range(3))
    assert sum(r["comm"]["state_bytes"] for r in results) >= 2 * 4 * real
    for result in results:
        assert result["prefetch_on"] == [False, True]  # the first step records the trace
        assert result["prefetch_off"] == [False, False]
