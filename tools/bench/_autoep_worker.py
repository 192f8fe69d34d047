"""One rank of `autoep.py`: forward + backward of a tiny Mixtral, HF under DDP vs DeepShard EP.

Both rows start from the same seeded weights and read the same per-rank batches:

* ``hf-ddp``: the unreplaced ``MixtralForCausalLM`` (transformers' own experts forward:
  in transformers 5 a grouped matrix multiply, ``torch._grouped_mm`` on CPU, not a loop) wrapped in
  ``torch.nn.parallel.DistributedDataParallel`` (its bucketed all-reduce overlaps backward);
* ``hf-ddp-loop``: the same under DDP with ``experts_implementation="eager"``, transformers'
  experts *loop* (one gather, two matrix multiplies and an ``index_add_`` per expert hit) — the
  baseline the issue's 1.2x target names;
* ``deepshard-ep2``: `deepshard.autoep.parallelize_experts` on the ``ep`` axis (each rank keeps
  half the experts, tokens move by all-to-all), then each gradient averaged over its
  placement's group: the dense ones flattened into one all-reduce over ``dp × ep``, the expert
  ones over ``dp`` (a single rank here, so nothing to send);
* ``hf-alone`` (a reference, not a competitor): the same HF model with no gradient exchange at
  all, each rank on its own batch. ``hf-ddp`` minus it is what DDP's all-reduce costs, so
  ``hf-ddp / hf-alone`` is what removing every gradient exchange would gain when the experts
  cost what HF's do (EP's may cost less: they are not a strict bound).

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

OURS = "deepshard-ep2"
LOOP_ROW = "hf-ddp-loop"
ROWS = ("hf-ddp", OURS, LOOP_ROW)
REFERENCE_ROW = "hf-alone"
DEEPSPEED_ROW = "deepspeed-autoep"


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
        num_experts_per_tok=spec["top_k"],
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


def _deepspeed_autoep(base: torch.nn.Module, spec: dict[str, Any], world: int) -> Any:
    """DeepSpeed v0.19.7's AutoEP engine on a copy of ``base``, or the error it raised.

    ``deepspeed.initialize`` replaces the Mixtral MoE blocks itself when the config has
    ``expert_parallel.enabled`` (its ``_configure_expert_parallel``), on the process group that
    is already initialized. Returns the engine, or the exception as a one-line string.
    """
    try:
        import deepspeed

        model = copy.deepcopy(base)
        config = {
            "train_micro_batch_size_per_gpu": spec["batch"],
            "gradient_accumulation_steps": 1,
            "expert_parallel": {"enabled": True, "autoep_size": world, "preset_model": "mixtral"},
        }
        engine, *_ = deepspeed.initialize(
            model=model, model_parameters=list(model.parameters()), config=config
        )
        ids = torch.zeros((spec["batch"], spec["seq"]), dtype=torch.long)
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.zero_grad()
        return engine
    except Exception as error:  # reported as the row's skip reason
        return f"{type(error).__name__}: {' '.join(str(error).split())[:300]}"


def _step(model: torch.nn.Module, ids: torch.Tensor, reduce: Any) -> float:
    start = time.perf_counter()
    loss = model(input_ids=ids, labels=ids).loss
    backward = getattr(model, "backward", None)  # a DeepSpeed engine reduces in its backward
    if callable(backward):
        backward(loss)
    else:
        loss.backward()
    reduce()
    elapsed = time.perf_counter() - start
    if callable(backward):
        model.zero_grad()
    else:
        model.zero_grad(set_to_none=True)
    return elapsed


def run_rank(job: dict[str, Any]) -> None:
    """Entry point of one rank process; rank 0 writes its timings to ``job['out']``."""
    rank, world = job["rank"], job["world"]
    store = dist.FileStore(job["store"], world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    spec = job["spec"]
    # DeepSpeed's initialize reads the launcher's variables even on an initialized group.
    os.environ.update({
        "RANK": str(rank), "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world),
    })  # fmt: skip
    dims = ParallelDims.build(Topology(ep=world))
    base = build_model(spec)
    ddp = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(base))
    loop_model = copy.deepcopy(base)
    loop_model.set_experts_implementation("eager")  # transformers' per-expert loop
    ddp_loop = torch.nn.parallel.DistributedDataParallel(loop_model)
    alone = copy.deepcopy(base)
    pristine = copy.deepcopy(base)  # DeepSpeed replaces the HF blocks itself
    ep_model = base
    report = parallelize_experts(ep_model, dims)
    gen = torch.Generator().manual_seed(100 + rank)
    ids = torch.randint(0, spec["vocab"], (spec["batch"], spec["seq"]), generator=gen)
    models = {"hf-ddp": (ddp, lambda: None), LOOP_ROW: (ddp_loop, lambda: None)}
    models[OURS] = (ep_model, lambda: _reduce_ep_grads(ep_model, dims, report.placements))
    models[REFERENCE_ROW] = (alone, lambda: None)
    rows: tuple[str, ...] = (*ROWS, REFERENCE_ROW)
    engine: Any = "left out (--no-deepspeed)"
    if spec.get("deepspeed", True):
        engine = _deepspeed_autoep(pristine, spec, world)
    skipped = engine if isinstance(engine, str) else None
    if skipped is None:
        models[DEEPSPEED_ROW] = (engine, lambda: None)
        rows = (*rows, DEEPSPEED_ROW)
    times: dict[str, list[float]] = {row: [] for row in rows}
    for step in range(spec["warmup"] + spec["steps"]):
        for row in rows if step % 2 == 0 else reversed(rows):
            model, reduce = models[row]
            dist.barrier()
            elapsed = _step(model, ids, reduce)
            if step >= spec["warmup"]:
                times[row].append(elapsed)
    if rank == 0:
        import json

        with open(job["out"], "w") as f:
            tokens = spec["batch"] * spec["seq"] * world
            json.dump({"times": times, "tokens_per_step": tokens, "deepspeed_skipped": skipped}, f)
    dist.destroy_process_group()
