"""One thread count of the `adam.py` race, run in a process of its own.

The parent starts this with ``OMP_NUM_THREADS`` already set to the thread count, so every
OpenMP runtime in the process comes up with that many threads; ``torch.set_num_threads`` is
called again here for torch's own pool. The worker probes and parity-checks each competitor,
then for every size runs the whole line-up ``rounds`` times (rotating the order each round),
each row bracketed by a STREAM triad burst, and writes what it measured to a JSON file after
every size, so a crash later on keeps the rows already measured.
"""

from __future__ import annotations

import gc
import json
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import _adam_competitors as competitors
import torch
from _adam_spec import bytes_per_param
from _host import last_level_cache_bytes
from _stream_triad import (
    BYTES_PER_ELEMENT,
    WRITE_ALLOCATE_FACTOR,
    StreamTriad,
    triad_elements,
)

TRIAD_PASSES = 3  # per burst; one burst before and one after each row
STREAM_NTIMES = 10  # the opening burst, as many passes as STREAM runs


@dataclass(frozen=True)
class Plan:
    """What one worker runs."""

    threads: int
    names: list[str]
    sizes: list[int]
    warmup: int
    steps: int
    rounds: int
    dtype: str = "fp32"


def _thread_cpu_ns() -> dict[str, int]:
    """On-CPU nanoseconds of each of this process's threads (Linux schedstat; else empty)."""
    on_cpu: dict[str, int] = {}
    tasks = Path("/proc/self/task")
    for task in tasks.iterdir() if tasks.is_dir() else []:
        try:
            on_cpu[task.name] = int((task / "schedstat").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            continue  # the thread ended, or the kernel keeps no schedstat
    return on_cpu


def _busy_threads(before: dict[str, int], after: dict[str, int], wall: float) -> int | None:
    """Threads that spent at least a quarter of ``wall`` on a CPU between two snapshots."""
    if not after:
        return None
    spent = [ns - before.get(tid, 0) for tid, ns in after.items()]
    return sum(1 for ns in spent if ns >= 0.25 * wall * 1e9)


def _time_steps(subject: competitors.Subject, warmup: int, steps: int) -> dict[str, Any]:
    """Median step seconds, CPU seconds per wall second and busy threads over ``steps``."""
    for _ in range(warmup):
        subject.step()
    times: list[float] = []
    per_thread, cpu_start, wall_start = _thread_cpu_ns(), time.process_time(), time.perf_counter()
    for _ in range(steps):
        start = time.perf_counter()
        subject.step()
        times.append(time.perf_counter() - start)
    wall = time.perf_counter() - wall_start
    return {
        "times": times,
        "cpu_per_wall": (time.process_time() - cpu_start) / wall,
        "busy_threads": _busy_threads(per_thread, _thread_cpu_ns(), wall),
    }


def _run_one(plan: Plan, name: str, size: int) -> dict[str, Any]:
    """One competitor, one size, one round: fresh state, timed, then freed."""
    subject = competitors.make(name, size, plan.threads, plan.dtype)
    try:
        return _time_steps(subject, plan.warmup, plan.steps)
    finally:
        del subject
        gc.collect()


def race_size(plan: Plan, names: list[str], triad: StreamTriad, size: int) -> list[dict[str, Any]]:
    """Every competitor in ``names`` over ``size`` parameters, ``plan.rounds`` times."""
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    bursts: dict[str, list[float]] = {name: [] for name in names}
    for round_index in range(plan.rounds):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            bursts[name].append(triad.burst(TRIAD_PASSES))
            runs[name].append(_run_one(plan, name, size))
            bursts[name].append(triad.burst(TRIAD_PASSES))
            median = statistics.median(runs[name][-1]["times"])
            print(f"  [{plan.threads} thr] {size:,} {name} round {round_index + 1}: "
                  f"{median:.4g} s/step", file=sys.stderr, flush=True)  # fmt: skip
    return [_row(plan, name, size, runs[name], max(bursts[name])) for name in names]


def _row(
    plan: Plan, name: str, size: int, runs: list[dict[str, Any]], triad: float
) -> dict[str, Any]:
    busy = [run["busy_threads"] for run in runs if run["busy_threads"] is not None]
    return {
        "name": name,
        "params": size,
        "threads": plan.threads,
        "seconds": statistics.median(t for run in runs for t in run["times"]),
        "round_seconds": [statistics.median(run["times"]) for run in runs],
        "triad": triad,
        "cpu_per_wall": statistics.mean(run["cpu_per_wall"] for run in runs),
        "busy_threads": statistics.median_low(busy) if busy else None,
        "bytes_per_param": bytes_per_param(plan.dtype),
    }


def _triage(plan: Plan, result: dict[str, Any]) -> list[str]:
    """Probes and parity-checks every competitor; returns the names fit to race."""
    ready = []
    for name in plan.names:
        reason = competitors.why_unavailable(name, plan.threads, plan.dtype)
        if reason is not None:
            result["missing"][name] = reason
            continue
        mismatch = competitors.parity_error(name, plan.threads, plan.dtype)
        if mismatch is not None:
            result["wrong"][name] = mismatch
            continue
        result["backends"][name] = competitors.backend(name)
        ready.append(name)
    return ready


def run(plan: Plan, out: Path) -> None:
    """Runs ``plan`` and writes the measurements to ``out`` as JSON."""
    torch.set_num_threads(plan.threads)
    result: dict[str, Any] = {
        "threads": plan.threads,
        "torch": torch.__version__,
        "rows": [],
        "missing": {},
        "wrong": {},
        "backends": {},
        "cache_bytes": last_level_cache_bytes(),
        "triad_bursts": [],
        "triad_bytes_per_element": BYTES_PER_ELEMENT,
        "triad_write_allocate_factor": WRITE_ALLOCATE_FACTOR,
    }
    names = _triage(plan, result)
    out.write_text(json.dumps(result))
    with tempfile.TemporaryDirectory() as build_dir:
        triad = StreamTriad(plan.threads, triad_elements(), Path(build_dir))
        result["triad_implementation"] = triad.implementation
        result["triad_bursts"] = triad.history
        triad.burst(STREAM_NTIMES)
        for size in plan.sizes if names else []:
            result["rows"] += race_size(plan, names, triad, size)
            out.write_text(json.dumps(result))
    out.write_text(json.dumps(result))
