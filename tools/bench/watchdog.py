"""Per-collective cost of the comms watchdog on 2 local gloo ranks (or 1, ``--world 1``).

Each rank issues ``--calls`` collectives of a small fp32 tensor (``--numel`` elements) per
round, in four variants that alternate round by round (so a slow phase of a shared machine hits
them alike): ``torch.distributed`` itself, DeepShard's collective without a watchdog, with a
`CommWatchdog` passed directly, and with one carried by a disabled `CommsLogger` (the engine's
way). The time per call is the round's wall time divided by the calls; the median over
``--rounds`` rounds is printed, with the watchdog's overhead against DeepShard without it. Ops:
``all_reduce`` (sync), ``all_reduce`` async then ``wait()``, and ``reduce_scatter_tensor``
(whose gloo work ignores a wait timeout, so the watchdog waits for it on a helper thread). A
world of one still runs gloo's code path but no network, so the overhead stands out of less
noise.

Run from the repository root::

    uv run --all-packages python tools/bench/watchdog.py

The same file is the rank script (``--as-rank R``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import _bench_json

VARIANTS = ("torch", "deepshard", "watchdog", "watchdog_via_logger")
OPS = ("all_reduce", "all_reduce_async", "reduce_scatter_tensor")


def _call(op: str, variant: str, tensor: Any, out: Any, extra: dict[str, Any]) -> Callable[[], Any]:
    import torch.distributed as dist

    import deepshard.comm as comm

    if variant == "torch":
        if op == "all_reduce":
            return lambda: dist.all_reduce(tensor)
        if op == "all_reduce_async":
            return lambda: dist.all_reduce(tensor, async_op=True).wait()  # type: ignore[union-attr]
        return lambda: dist.reduce_scatter_tensor(out, tensor)
    if op == "all_reduce":
        return lambda: comm.all_reduce(tensor, **extra)
    if op == "all_reduce_async":
        return lambda: comm.all_reduce(tensor, async_op=True, **extra).wait()
    return lambda: comm.reduce_scatter_tensor(tensor, output=out, **extra)


def _rank_main(rank: int, store_path: str, args: argparse.Namespace) -> None:
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    import deepshard.comm as comm
    from deepshard.interface.config.comms_logger import CommsLoggerConfig

    world = args.world
    store = dist.FileStore(store_path, world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(60))
    dog = comm.CommWatchdog(120.0)
    quiet = comm.CommsLogger(CommsLoggerConfig(enabled=False), watchdog=dog)
    extras: dict[str, dict[str, Any]] = {
        "torch": {},
        "deepshard": {"group": dist.group.WORLD},
        "watchdog": {"group": dist.group.WORLD, "watchdog": dog},
        "watchdog_via_logger": {"group": dist.group.WORLD, "logger": quiet},
    }
    tensor, out = torch.ones(args.numel), torch.empty(args.numel // world)
    results: dict[str, dict[str, list[float]]] = {op: {v: [] for v in VARIANTS} for op in OPS}
    for op in OPS:
        calls = {v: _call(op, v, tensor, out, extras[v]) for v in VARIANTS}
        for fn in calls.values():  # warm-up
            for _ in range(50):
                fn()
        for round_ in range(args.rounds):
            order = VARIANTS[round_ % 4 :] + VARIANTS[: round_ % 4]
            for variant in order:
                fn = calls[variant]
                dist.barrier()
                start = time.perf_counter()
                for _ in range(args.calls):
                    fn()
                results[op][variant].append((time.perf_counter() - start) / args.calls * 1e6)
    dog.close()
    dist.destroy_process_group()
    if rank == 0:
        print(json.dumps(results))


def _print_table(results: dict[str, dict[str, list[float]]]) -> None:
    print(f"{'op':<24}" + "".join(f"{v:>22}" for v in VARIANTS) + f"{'overhead':>12}")
    for op, by_variant in results.items():
        medians = {v: statistics.median(times) for v, times in by_variant.items()}
        cells = "".join(f"{medians[v]:>19.1f} us" for v in VARIANTS)
        overhead = medians["watchdog"] - medians["deepshard"]
        print(f"{op:<24}{cells}{overhead:>+9.1f} us")
    print("(median per call over the rounds; overhead = watchdog - deepshard)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--calls", type=int, default=200, help="calls per round and variant")
    parser.add_argument("--rounds", type=int, default=40, help="rounds per op")
    parser.add_argument("--world", type=int, default=2, choices=(1, 2), help="ranks")
    parser.add_argument("--numel", type=int, default=16, help="elements of the tensor (even)")
    parser.add_argument("--json", type=Path, help="also write the ratios as JSON (for run.py)")
    parser.add_argument("--as-rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--store", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.as_rank is not None:
        _rank_main(args.as_rank, args.store, args)
        return
    with tempfile.TemporaryDirectory() as tmp:
        store = str(Path(tmp) / "store")
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        argv = [sys.executable, __file__, "--store", store, "--calls", str(args.calls)]
        argv += ["--rounds", str(args.rounds), "--numel", str(args.numel)]
        argv += ["--world", str(args.world)]
        procs = [
            subprocess.Popen(
                [*argv, "--as-rank", str(r)], env=env, stdout=subprocess.PIPE, text=True
            )
            for r in range(args.world)
        ]
        outputs = [p.communicate(timeout=600)[0] for p in procs]
        if any(p.returncode for p in procs):
            sys.exit("a rank failed")
    results = json.loads(outputs[0].strip().splitlines()[-1])
    _print_table(results)
    _write_json(args.json, results)


def _write_json(path: Path | None, results: dict[str, dict[str, list[float]]]) -> None:
    """Round-by-round ratios of each DeepShard variant to ``torch.distributed`` per op."""
    rows, figures = [], {}
    for op, by_variant in results.items():
        for variant in VARIANTS:
            figures[f"{variant} {op}"] = {
                "time_s": [us * 1e-6 for us in by_variant[variant]],
                "peak_mib": None,
            }
            if variant != "torch":
                ratios = _bench_json.paired_ratios(by_variant[variant], by_variant["torch"])
                rows.append(
                    _bench_json.ratio_row(f"{variant} {op}", f"torch {op}", "time/call", ratios)
                )
    _bench_json.write(path, "watchdog", rows, figures)


if __name__ == "__main__":
    main()
