"""One rank of `autoep.py`: forward + backward of a tiny Mixtral, HF under DDP vs DeepShard EP.

Both rows start from the same seeded weights and read the same per-rank batches:

* ``hf-ddp``: the unreplaced ``MixtralForCausalLM`` (transformers' own experts loop) wrapped in
  ``torch.nn.parallel.DistributedDataParallel`` (its bucketed all-reduce overlaps backward);
* ``deepshard-ep2``: `deepshard.autoep.parallelize_experts` on the ``ep`` axis (each rank keeps
  half the experts, tokens move by all-to-all), then each gradient averaged over its
  placement's group: the dense ones flattened into one all-reduce over ``dp × ep``, the expert
  ones over ``dp`` (a single rank here, so nothing to send).

A step is forward + backward + gradient reduction (no optimizer step: it is the same for both
and not what expert parallelism changes). Rows alternate step by step after a warm-up, so a
load spike on the shared machine hits both alike; rank 0 reports every timed step.
"""

from __future__ import annotations

import copy
import os
import time
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch
import torch.distributed as dist
import transformers

from deepshard.autoep import parallelize_experts
from deepshard.comm import ParallelDims, all_reduce
from deepshard.interface import Topology

ROWS = ("hf-ddp", "deepshard-ep2")


def build_model(spec: dict[str, Any]) -> torch.nn.Module:
    """The seeded tiny Mixtral every row starts from."""
    torch.manual_seed(0)
    config = transformers.MixtralConfig(
        vocab_size=spec["vocab"],
        hidden_size=spec["hidden"],
        intermediate_size=spec["intermediate"],
        num_hidden_layers=spec["layers"],
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=spec["experts"],
        num_experts_per_tok=2,
        max_position_embeddings=spec["seq"],
        attn_implementation="sdpa",
    )
    return transformers.MixtralForCausalLM(config).float()


def _reduce_ep_grads(model: torch.nn.Module, dims: ParallelDims, placements: Any) -> None:
    dense = [p for n, p in model.named_parameters() if placements[n].reduce_over != ("dp",)]
    flat = torch.cat([p.grad.reshape(-1) for p in dense if p.grad is not None])
    all_reduce(flat, group=dims.dense_dp, op="avg").wait()
    offset = 0
    for p in dense:
        if p.grad is not None:
            p.grad.copy_(flat[offset : offset + p.numel()].view_as(p))
            offset += p.numel()
    if dims.expert_dp.size() > 1:
        for n, p in model.named_parameters():
            if placements[n].reduce_over == ("dp",) and p.grad is not None:
                all_reduce(p.grad, group=dims.expert_dp, op="avg").wait()


def _step(model: torch.nn.Module, ids: torch.Tensor, reduce: Any) -> float:
    start = time.perf_counter()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    reduce()
    elapsed = time.perf_counter() - start
    model.zero_grad(set_to_none=True)
    return elapsed


def run_rank(job: dict[str, Any]) -> None:
    """Entry point of one rank process; rank 0 writes its timings to ``job['out']``."""
    rank, world = job["rank"], job["world"]
    store = dist.FileStore(job["store"], world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    spec = job["spec"]
    dims = ParallelDims.build(Topology(ep=world))
    base = build_model(spec)
    ddp = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(base))
    ep_model = base
    report = parallelize_experts(ep_model, dims)
    gen = torch.Generator().manual_seed(100 + rank)
    ids = torch.randint(0, spec["vocab"], (spec["batch"], spec["seq"]), generator=gen)
    models = {"hf-ddp": (ddp, lambda: None)}
    models["deepshard-ep2"] = (
        ep_model,
        lambda: _reduce_ep_grads(ep_model, dims, report.placements),
    )
    times: dict[str, list[float]] = {row: [] for row in ROWS}
    for step in range(spec["warmup"] + spec["steps"]):
        for row in ROWS if step % 2 == 0 else reversed(ROWS):
            model, reduce = models[row]
            dist.barrier()
            elapsed = _step(model, ids, reduce)
            if step >= spec["warmup"]:
                times[row].append(elapsed)
    if rank == 0:
        import json

        with open(job["out"], "w") as f:
            json.dump({"times": times, "tokens_per_step": spec["batch"] * spec["seq"] * world}, f)
    dist.destroy_process_group()
