"""One rank of one competitor in the `zero.py` race, in a process forked from a warm server.

The rank joins a gloo world of its own (a fresh port per competitor), builds the model with the
shared seed, wraps it the competitor's way, trains ``warmup + steps`` steps on its own token
batches and writes a JSON report: the wall time of each timed step, every step's loss, and the
peak resident memory growth since the process started (``VmHWM`` after resetting it through
``/proc/self/clear_refs``, minus the ``VmRSS`` at start), plus DeepShard's own tensor-byte count.
When DeepShard's engine refuses the row's config the report is ``{"refused": <its first line>}``
and the rank trains nothing.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from _zero_competitors import BUILDERS, Refused
from _zero_lineup import BY_NAME
from _zero_model import FULL, QUICK, batch, make_model


@dataclass(frozen=True)
class RankJob:
    """What one rank runs."""

    competitor: str
    rank: int
    world: int
    port: int
    threads: int
    quick: bool
    warmup: int
    steps: int
    out: str
    dtype: str = "fp32"


def _status_kib(field: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def _reset_peak_rss() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def _log_to(path: str) -> None:
    """Send this process's stdout and stderr (C-level writes too) to ``path``."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    for stream in (1, 2):
        os.dup2(fd, stream)
    os.close(fd)


def run_rank(job: RankJob) -> None:
    """Train as ``job`` says and write the report to ``job.out`` (output to ``job.out``.log)."""
    _log_to(job.out + ".log")
    os.environ.update(
        RANK=str(job.rank),
        LOCAL_RANK=str(job.rank),
        WORLD_SIZE=str(job.world),
        LOCAL_WORLD_SIZE=str(job.world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(job.port),
    )
    torch.set_num_threads(job.threads)
    peak_reset = _reset_peak_rss()
    rss_start = _status_kib("VmRSS")
    shape = QUICK if job.quick else FULL
    model = make_model(shape)
    # Counted before wrapping: ZeRO-3 engines leave empty placeholders in the module.
    params = sum(p.numel() for p in model.parameters())
    competitor = BY_NAME[job.competitor]
    try:
        step, tensor_bytes = BUILDERS[competitor.family](
            model, competitor, shape.micro_batch, job.dtype
        )
    except Refused as refusal:
        # DeepShard checks its config before joining the world, so no peer waits on this rank.
        Path(job.out).write_text(json.dumps({"refused": refusal.args[0]}))
        if dist.is_initialized():
            dist.destroy_process_group()
        return
    losses, times = [], []
    for index in range(job.warmup + job.steps):
        ids = batch(shape, index, job.rank)
        if index == job.warmup:
            dist.barrier()
        start = time.perf_counter()
        loss = step(ids).item()
        if index >= job.warmup:
            times.append(time.perf_counter() - start)
        losses.append(loss)
    peak = _status_kib("VmHWM")
    report = {
        "times": times,
        "losses": losses,
        "params": params,
        "rss_delta": None if peak is None or rss_start is None else (peak - rss_start) * 1024,
        "peak_reset": peak_reset,
        "tensor_bytes": tensor_bytes(),
    }
    Path(job.out).write_text(json.dumps(report))
    dist.barrier()
    dist.destroy_process_group()
