"""Stage 3 on 2 ranks: prefetch hides parameter all-gathers behind compute.

A chain of ``Linear(512, 512)`` units (each followed by ``tanh``) on 512 rows per rank: one
unit's matmuls take several milliseconds on one thread, its gather moves 1 MiB. Two copies of
the model train side by side, steps interleaved so both see the same load on the box: one with
``prefetch_bucket_size`` 0 (every gather is issued when its unit needs it and waited for
whole), one prefetching one unit ahead (a bucket of exactly one unit's elements). The exposed
gather time (`ShardedModule.gather_waits`: blocking waits only) must fall clearly with
prefetch on, while the comms logger shows the same gathers happening.

What prefetch issued is checked from the fetcher's own counts, derived from the schedule: in a
steady step every unit but the first is prefetched in forward (by the unit before it), and in
backward every unit but the last (which stays gathered: ``max_reuse_distance`` 0 still keeps a
unit whose next use is the very next one) is prefetched by the unit after it — ``2 × (K - 1)``
gathers, each found already under way when its unit needed it.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

import torch

from deepshard.testing import run_on_mesh

_WIDTH, _UNITS, _ROWS, _STEPS = 512, 4, 512, 7


def _unit_numel(world: int) -> int:
    """A Linear unit's padded elements: weight (a multiple of 4), bias, rounded to ``world × 4``."""
    raw = _WIDTH * _WIDTH + _WIDTH
    return -(-raw // (4 * world)) * (4 * world)


def _build(group: Any, bucket: int) -> tuple[Any, Any, Any, Any]:
    from deepshard.comm import CommsLogger
    from deepshard.interface.config import CommsLoggerConfig, ZeroConfig
    from deepshard.zero import ZeroOptimizer, ZeroPolicy, shard

    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(_UNITS):
        layers += [torch.nn.Linear(_WIDTH, _WIDTH), torch.nn.Tanh()]
    model = torch.nn.Sequential(*layers)
    logger = CommsLogger(CommsLoggerConfig(enabled=True))
    policy = ZeroPolicy(
        unit_classes=(torch.nn.Linear,),
        prefetch_bucket_size=bucket,
        max_reuse_distance=0,
        param_persistence_threshold=0,
    )
    sharded = shard(model, group=group, policy=policy, comms_logger=logger)
    inner = torch.optim.SGD(model.parameters(), lr=1e-3)
    zero = ZeroOptimizer(inner, sharded, config=ZeroConfig(stage=3), comms_logger=logger)
    return model, sharded, zero, logger


def _step(run: tuple[Any, Any, Any, Any], x: torch.Tensor) -> dict[str, float]:
    model, sharded, zero, logger = run
    waits = sharded.gather_waits
    exposed, prefetched, hits, calls = (
        waits.exposed_s,
        waits.prefetched,
        waits.prefetch_hits,
        logger.call_count,
    )
    zero.backward(model(x).pow(2).mean())
    zero.step()
    new = logger.records[len(logger.records) - (logger.call_count - calls) :]
    gathers = [r for r in new if r.op == "all_gather_into_tensor"]
    return {
        "exposed_s": waits.exposed_s - exposed,
        "prefetched": waits.prefetched - prefetched,
        "hits": waits.prefetch_hits - hits,
        "gathers": len(gathers),
        "gather_s": sum(r.latency_s for r in gathers),
    }


def _interleaved(mesh: Any) -> dict[str, list[dict[str, float]]]:
    group = mesh["dp"]
    runs = {"off": _build(group, 0), "on": _build(group, _unit_numel(group.size()))}
    x = torch.randn(_ROWS, _WIDTH, generator=torch.Generator().manual_seed(mesh.get_rank()))
    steps: dict[str, list[dict[str, float]]] = {"off": [], "on": []}
    for _ in range(_STEPS):
        for name, run in runs.items():
            steps[name].append(_step(run, x))
    return steps


def test_prefetch_lowers_the_exposed_gather_time(tmp_path: Path) -> None:
    results = run_on_mesh(_interleaved, 2, store_dir=tmp_path, timeout_s=90)
    for steps in results:
        off, on = steps["off"][1:], steps["on"][1:]  # step 0 records the trace
        for step in off + on:  # the same gathers either way: every unit in forward and, but
            assert step["gathers"] == 2 * _UNITS - 1  # the last (kept), in backward
        assert all(s["prefetched"] == 0 and s["hits"] == 0 for s in off)
        assert all(s["prefetched"] == 2 * (_UNITS - 1) for s in on)
        assert all(s["hits"] == s["prefetched"] for s in on)  # issued before they were needed
        exposed_off = statistics.median(s["exposed_s"] for s in off)
        exposed_on = statistics.median(s["exposed_s"] for s in on)
        assert exposed_off > 0
        # without prefetch a needed gather is waited for from issue to completion: most of it
        assert exposed_off > 0.5 * statistics.median(s["gather_s"] for s in off)
        assert exposed_on < 0.7 * exposed_off, (exposed_on, exposed_off)
