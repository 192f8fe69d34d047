"""One rank of one row of `autotp.py`: a Llama split two ways (or whole), its steps and memory.

Every row builds the same ``LlamaForCausalLM`` from a config with seed 0 (fp32, CPU), wraps it
its own way, and trains ``warmup`` untimed and ``steps`` timed steps on the same token batch
per step on every rank (a tensor-parallel group shares its batch). A step is forward (the
model's own causal-LM loss), backward and an AdamW step with zeroed gradients; no clipping, so
every row runs the same arithmetic. Its time is rank 0's wall time, after a barrier before the
first timed step.

Memory, per rank (the report takes the larger rank):

* **parameter bytes**: the bytes of the parameters this rank holds after wrapping (a DTensor's
  local shard), counted once per storage;
* **peak RSS growth**: Linux ``VmHWM`` after resetting it through ``/proc/self/clear_refs``,
  minus ``VmRSS`` before the model is built — what the process really touched for the model,
  gradients, AdamW state, activations and communication buffers, allocator included (as
  `zero.py` measures).
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

LR, WEIGHT_DECAY = 1e-4, 0.01
GROUP_TIMEOUT = datetime.timedelta(seconds=300)
"""A rank whose peer died fails a collective after this instead of gloo's 30 minutes."""


@dataclass(frozen=True)
class Shape:
    """The model and batch of one bench size."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    micro_batch: int
    seq: int


FULL = Shape(512, 1408, 8, 8, 4, 8192, 2, 128)
"""31.99M parameters: 8 layers of 2.95M, an untied embedding and LM head of 4.19M each."""
QUICK = Shape(64, 128, 2, 8, 2, 128, 2, 16)
"""The issue's tiny Llama (vocab 128, hidden 64, intermediate 128, 2 layers, 8/2 heads)."""


@dataclass(frozen=True)
class RankJob:
    """What one rank process runs."""

    row: str
    rank: int
    world: int
    store: str
    quick: bool
    warmup: int
    steps: int
    out: str


def make_model(shape: Shape) -> torch.nn.Module:
    """The bench's Llama from its config: seed 0, fp32, untied, sdpa attention, no KV cache."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        vocab_size=shape.vocab,
        max_position_embeddings=max(shape.seq, 128),
        tie_word_embeddings=False,
        attn_implementation="sdpa",
        use_cache=False,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config).float()


def batch(shape: Shape, step: int) -> torch.Tensor:
    """Step ``step``'s token ids, the same on every rank."""
    gen = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, shape.vocab, (shape.micro_batch, shape.seq), generator=gen)


StepFn = Callable[[torch.Tensor], torch.Tensor]


def _plain_step(model: torch.nn.Module) -> StepFn:
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)

    def step(ids: torch.Tensor) -> torch.Tensor:
        loss: torch.Tensor = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    return step


def _engine_config(shape: Shape) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": shape.micro_batch,
        "gradient_accumulation_steps": 1,
        "tensor_parallel": {"autotp_size": 2},
        "zero_optimization": {"stage": 0},
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": LR, "weight_decay": WEIGHT_DECAY, "torch_adam": True},
        },
    }


def _engine_step(engine: Any) -> StepFn:
    def step(ids: torch.Tensor) -> torch.Tensor:
        loss: torch.Tensor = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        return loss

    return step


def build_deepshard(model: torch.nn.Module, shape: Shape) -> tuple[torch.nn.Module, StepFn]:
    """What a user writes: ``deepshard.engine.initialize`` with ``autotp_size: 2``, ZeRO-0."""
    import deepshard.engine as ds

    engine, _, _, _ = ds.initialize(model, _engine_config(shape))
    return engine.module, _engine_step(engine)


def build_deepspeed(model: torch.nn.Module, shape: Shape) -> tuple[torch.nn.Module, StepFn]:
    """DeepSpeed 0.19.7's AutoTP training: ``deepspeed.initialize`` with the same config."""
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    engine, _, _, _ = deepspeed.initialize(model=model, config=_engine_config(shape))
    return engine.module, _engine_step(engine)


def build_dtensor(model: torch.nn.Module, shape: Shape) -> tuple[torch.nn.Module, StepFn]:
    """``parallelize_module`` with the plan AutoTP applies (the model's own HF ``tp_plan``):
    vocab-parallel embedding, column q/k/v/gate/up, row o/down, column LM head gathered."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    plan: dict[str, Any] = {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate()),
        "lm_head": ColwiseParallel(output_layouts=Replicate()),
    }
    for i in range(shape.layers):
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"):
            plan[f"model.layers.{i}.{name}"] = ColwiseParallel()
        for name in ("mlp.gate_proj", "mlp.up_proj"):
            plan[f"model.layers.{i}.{name}"] = ColwiseParallel()
        plan[f"model.layers.{i}.self_attn.o_proj"] = RowwiseParallel()
        plan[f"model.layers.{i}.mlp.down_proj"] = RowwiseParallel()
    parallelize_module(model, mesh, plan)
    return model, _plain_step(model)


def build_unsharded(model: torch.nn.Module, shape: Shape) -> tuple[torch.nn.Module, StepFn]:
    """The whole model on one rank with ``torch.optim.AdamW``: the memory reference."""
    return model, _plain_step(model)


BUILDERS = {
    "deepshard-tp2": build_deepshard,
    "deepspeed-tp2": build_deepspeed,
    "dtensor-tp2": build_dtensor,
    "unsharded": build_unsharded,
}
WORLDS = {"deepshard-tp2": 2, "deepspeed-tp2": 2, "dtensor-tp2": 2, "unsharded": 1}


def parameter_bytes(model: torch.nn.Module) -> int:
    """Bytes of the parameters this rank holds (a DTensor's local shard), once per storage."""
    from torch.distributed.tensor import DTensor

    seen: dict[int, int] = {}
    for param in model.parameters():
        local = param.to_local() if isinstance(param, DTensor) else param
        storage = local.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def _status_kib(field: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def _reset_peak_rss() -> None:
    with contextlib.suppress(OSError):  # not Linux, or not allowed: the peak is since start
        Path("/proc/self/clear_refs").write_text("5")


def _train(job: RankJob) -> dict[str, Any]:
    shape = QUICK if job.quick else FULL
    _reset_peak_rss()
    rss_start = _status_kib("VmRSS")
    model = make_model(shape)
    params = sum(p.numel() for p in model.parameters())
    module, step = BUILDERS[job.row](model, shape)
    times, losses = [], []
    for index in range(job.warmup + job.steps):
        ids = batch(shape, index)
        if index == job.warmup:
            dist.barrier()
        start = time.perf_counter()
        loss = step(ids)
        elapsed = time.perf_counter() - start
        losses.append(float(loss.detach()))
        if index >= job.warmup:
            times.append(elapsed)
    peak = _status_kib("VmHWM")
    rss = None if peak is None or rss_start is None else (peak - rss_start) * 1024
    return {
        "times": times,
        "losses": losses,
        "params": params,
        "param_bytes": parameter_bytes(module),
        "rss_delta": rss,
    }


def _log_to(path: str) -> None:
    """Send this process's stdout and stderr (C-level writes too) to ``path``."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    for stream in (1, 2):
        os.dup2(fd, stream)
    os.close(fd)


def run_rank(job: RankJob) -> None:
    """Entry point of a rank process: joins its gloo world, trains, writes its report."""
    _log_to(job.out + ".log")
    os.environ.update(
        RANK=str(job.rank),
        LOCAL_RANK=str(job.rank),
        WORLD_SIZE=str(job.world),
        LOCAL_WORLD_SIZE=str(job.world),
        DS_ACCELERATOR="cpu",
    )
    torch.set_num_threads(1)
    try:
        store = dist.FileStore(job.store, job.world)
        dist.init_process_group(
            "gloo", store=store, rank=job.rank, world_size=job.world, timeout=GROUP_TIMEOUT
        )
        report = _train(job)
        dist.barrier()
        dist.destroy_process_group()
    except Exception as exc:  # the parent prints why a row could not run
        report = {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()}
    Path(job.out).write_text(json.dumps(report))
