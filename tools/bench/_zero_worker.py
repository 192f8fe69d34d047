"""One rank of one competitor in the `zero.py` race, in a process forked from a warm server.

The rank joins a gloo world of its own (a fresh port per competitor), builds the model with the
shared seed, wraps it the competitor's way, trains ``warmup + steps`` steps on its own token
batches and writes a JSON report: the wall time of each timed step, every step's loss, and the
peak resident memory growth since the process started (``VmHWM`` after resetting it through
``/proc/self/clear_refs``, minus the ``VmRSS`` at start), plus DeepShard's own tensor-byte count.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from _zero_model import FULL, QUICK, batch, make_model

LR = 1e-3
CLIP = 1.0

StepFn = Callable[[torch.Tensor], torch.Tensor]


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


def _ds_config(stage: int, micro_batch: int) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": CLIP,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "torch_adam": True}},
        "zero_optimization": {"stage": stage},
        "steps_per_print": 10**9,
    }


def _ddp(model: torch.nn.Module, micro_batch: int) -> tuple[StepFn, Callable[[], Any]]:
    dist.init_process_group("gloo")
    wrapped = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)

    def step(ids: torch.Tensor) -> torch.Tensor:
        loss = wrapped(ids)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    return step, lambda: None


def _deepspeed(
    model: torch.nn.Module, micro_batch: int, stage: int
) -> tuple[StepFn, Callable[[], Any]]:
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=_ds_config(stage, micro_batch)
    )

    def step(ids: torch.Tensor) -> torch.Tensor:
        loss = engine(ids)
        engine.backward(loss)
        engine.step()
        return loss

    return step, lambda: None


def _deepshard(
    model: torch.nn.Module, micro_batch: int, stage: int
) -> tuple[StepFn, Callable[[], Any]]:
    import deepshard.engine as ds

    engine, _, _, _ = ds.initialize(model, _ds_config(stage, micro_batch))

    def step(ids: torch.Tensor) -> torch.Tensor:
        loss = engine(ids)
        engine.backward(loss)
        engine.step()
        return loss

    def tensor_bytes() -> dict[str, int]:
        counts = engine.memory_bytes()
        return {
            "parameters": counts.parameters,
            "gradients": counts.gradients,
            "master_weights": counts.master_weights,
            "optimizer_state": counts.optimizer_state,
        }

    return step, tensor_bytes


def _setup(job: RankJob, model: torch.nn.Module, micro_batch: int) -> tuple[StepFn, Any]:
    kind, _, stage = job.competitor.partition("-")
    if kind == "ddp":
        return _ddp(model, micro_batch)
    if kind == "deepspeed":
        return _deepspeed(model, micro_batch, int(stage))
    return _deepshard(model, micro_batch, int(stage))


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
    step, tensor_bytes = _setup(job, model, shape.micro_batch)
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
        "params": sum(p.numel() for p in model.parameters()),
        "rss_delta": None if peak is None or rss_start is None else (peak - rss_start) * 1024,
        "peak_reset": peak_reset,
        "tensor_bytes": tensor_bytes(),
    }
    Path(job.out).write_text(json.dumps(report))
    dist.barrier()
    dist.destroy_process_group()
