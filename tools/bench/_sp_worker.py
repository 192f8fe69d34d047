"""One rank of `sequence_parallel.py`: a tiny Llama step at a long sequence, and its memory.

Memory is **tensor-byte accounting** (CPU has no allocator statistics): a `TorchDispatchMode`
records the storage of every tensor an op creates during forward and backward, holds only a
weak reference to it (``StorageWeakRef``), and after each op sums the storages still alive.
The peak of that sum is the step's activation peak: everything autograd saved, the transient
buffers, the gradients, and tensors autograd Functions keep on their ``ctx`` (which
``saved_tensors_hooks`` would miss). Parameters and optimizer state exist before the step and
are not counted. The peak comes from one extra step after the timed ones, the only step the
tracker watches: its Python runs after every op, a cost that would otherwise be timed too. The
logits peak is measured the same way around the LM head and the loss alone, on this rank's
final hidden states.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

HIDDEN, LAYERS, HEADS, KV_HEADS, INTERMEDIATE, VOCAB = 64, 2, 4, 2, 256, 4096
TILED = {"tiled_mlp": True, "tiled_logits_loss": True, "tiled_logits_shards": 8}


@dataclass(frozen=True)
class RankJob:
    """What one rank process runs."""

    row: str
    rank: int
    world: int
    store: str
    seq: int
    warmup: int
    steps: int
    out: str


class LiveTensorBytes(TorchDispatchMode):
    """The peak bytes of live tensor storages created under the mode."""

    def __init__(self) -> None:
        super().__init__()
        self._refs: dict[int, tuple[StorageWeakRef, int]] = {}
        self.peak = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        self._refs = {k: v for k, v in self._refs.items() if not v[0].expired()}
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor) and not tensor.is_meta:
                storage = tensor.untyped_storage()
                if storage.data_ptr() and storage.data_ptr() not in self._refs:
                    self._refs[storage.data_ptr()] = (StorageWeakRef(storage), storage.nbytes())
        self.peak = max(self.peak, sum(n for _, n in self._refs.values()))
        return out


def _llama() -> Any:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        vocab_size=VOCAB,
        max_position_embeddings=1 << 16,
        attn_implementation="sdpa",
        use_cache=False,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config).float()


def _batch(seq: int, step: int, replica: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * step + replica)
    ids = torch.randint(0, VOCAB, (1, seq), generator=gen)
    labels = ids.clone()
    labels[0, : seq // 8] = -100
    return {"input_ids": ids, "labels": labels}


def _deepshard(job: RankJob) -> tuple[Any, Any, Any]:
    """The engine, its loader-side sharder and its batch source for a ``sp*`` row."""
    import deepshard.engine as ds
    from deepshard.comm import ParallelDims
    from deepshard.interface import Topology
    from deepshard.sequence_parallel import shard_batch

    sp = 2 if job.row.startswith("sp2") else 1
    dims = ParallelDims.build(Topology(dp=job.world // sp, sp=sp))
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "sequence_parallel_size": sp,
        "sequence_parallel": TILED if job.row.endswith("tiled") else {},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
    }
    engine, _, _, _ = ds.initialize(_llama(), config, mesh=dims)

    def batch(step: int) -> dict[str, Any]:
        whole = _batch(job.seq, step, dims.batch_rank)
        return shard_batch(whole, sp_rank=dims.sp.get_local_rank(), sp_size=sp)

    return engine, engine, batch


def _deepspeed(job: RankJob) -> tuple[Any, Any, Any]:
    """DeepSpeed 0.19.7's ALST (UlyssesSPAttentionHF + its loss recipe) at sp 2."""
    import deepspeed
    import deepspeed.comm as dist_ds
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

    model = _llama()
    mpu = UlyssesSPAttentionHF.register_with_transformers(
        model, core_attn_implementation="sdpa", sequence_parallel_size=2, micro_batch_size=1
    )
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "sequence_parallel_size": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
        "zero_optimization": {"stage": 0},
    }
    engine, _, _, _ = deepspeed.initialize(model=model, config=config, mpu=mpu)
    group, rank = mpu.get_sequence_parallel_group(), mpu.get_sequence_parallel_rank()
    from deepshard.sequence_parallel import shard_batch  # the same shards as DeepShard's

    def batch(step: int) -> dict[str, Any]:
        return shard_batch(_batch(job.seq, step, 0), sp_rank=rank, sp_size=2)

    class Loss:  # DeepSpeed's recipe: per-shard losses weighted by valid tokens
        def __call__(self, **shard: Any) -> Any:
            shift = shard.pop("shift_labels")
            shard.pop("labels")
            logits = engine(**shard).logits
            loss = torch.nn.functional.cross_entropy(
                logits.float().reshape(-1, VOCAB), shift.reshape(-1), reduction="sum"
            )
            good = (shift != -100).sum()
            losses = torch.distributed.nn.functional.all_gather(loss, group=group)
            goods = [torch.zeros_like(good) for _ in range(2)]
            dist_ds.all_gather(goods, good, group=group)
            return type("Out", (), {"loss": sum(losses) / max(sum(goods), 1)})()

    return engine, Loss(), batch


def _logits_peak(job: RankJob, engine: Any, shard: dict[str, Any]) -> int:
    """Peak live bytes of the LM head + loss alone (tiled as the row's model is)."""
    module = engine.module
    with torch.no_grad():
        kwargs = {k: v for k, v in shard.items() if k in ("input_ids", "position_ids")}
        hidden = module.model(**kwargs).last_hidden_state
    hidden.requires_grad_(True)
    shift = shard["shift_labels"]
    tracker = LiveTensorBytes()
    with tracker:
        if job.row.endswith("tiled"):
            from deepshard.sequence_parallel._hf_tiled import _token_loss_sum
            from deepshard.sequence_parallel.tiled import tiled_fused_logits_loss

            shards = int(TILED["tiled_logits_shards"])
            loss = tiled_fused_logits_loss(
                _token_loss_sum, module.lm_head, hidden, shift, None, shards, "sum"
            )
        else:
            logits = module.lm_head(hidden).float()
            loss = torch.nn.functional.cross_entropy(
                logits.reshape(-1, VOCAB), shift.reshape(-1), reduction="sum"
            )
            del logits
        loss.backward()
    module.zero_grad(set_to_none=True)
    return tracker.peak


def _train(job: RankJob) -> dict[str, Any]:
    """Warm-up steps, timed steps, then one step under `LiveTensorBytes` for the peak.

    The tracker runs Python after every op, a cost that grows with the op count and the live
    tensors, so a step it watches is not timed and a timed step is not watched.
    """
    build = _deepspeed if job.row.startswith("deepspeed") else _deepshard
    engine, forward, batch = build(job)
    times, losses, peak = [], [], 0
    for step in range(job.warmup + job.steps + 1):
        shard = batch(step)
        tracked = step == job.warmup + job.steps
        tracker = LiveTensorBytes() if tracked else contextlib.nullcontext()
        start = time.perf_counter()
        with tracker:
            loss = forward(**shard).loss
            engine.backward(loss)
        engine.step()
        elapsed = time.perf_counter() - start
        losses.append(float(loss.detach()))
        if isinstance(tracker, LiveTensorBytes):
            peak = tracker.peak
        elif step >= job.warmup:
            times.append(elapsed)
    logits = _logits_peak(job, engine, batch(0)) if not job.row.startswith("deepspeed") else 0
    return {"times": times, "peak": peak, "logits_peak": logits, "losses": losses}


def run_rank(job: RankJob) -> None:
    """Entry point of a rank process: joins the gloo world, trains, writes its report."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.update(
        {"RANK": str(job.rank), "WORLD_SIZE": str(job.world), "LOCAL_RANK": str(job.rank)}
    )
    try:
        store = torch.distributed.FileStore(job.store, job.world)
        torch.distributed.init_process_group(
            "gloo", store=store, rank=job.rank, world_size=job.world
        )
        if job.row.startswith("deepspeed"):
            import deepspeed

            deepspeed.init_distributed(dist_backend="gloo")
        report = _train(job)
    except Exception as exc:  # the parent prints why a row could not run
        report = {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()}
    Path(job.out).write_text(json.dumps(report))
