"""One rank of one competitor in the `checkpoint.py` race, in a process forked from a warm server.

Every competitor saves and loads the same training state of the same model: the fp32 weights
and AdamW's two moments (12 bytes per parameter) on 2 gloo ranks. A rank writes a JSON report:
rank 0's wall times (between barriers, so the slower rank counts), the bytes on disk, and for
DeepShard the async save's blocking time. Before every load the written files are evicted from
the page cache (``posix_fadvise(DONTNEED)`` after an ``fsync``), so loads read the disk, not
memory, for every competitor alike. Every competitor's load is timed `LOAD_TRIES` times, each
after an eviction, and the fastest counts (``load_s``; all of them in ``load_tries_s``): on the
virtual disk of the development box the first read of a file after other I/O is often 2-4x
slower than the next read of the same evicted file (0.6 s against 2.1 s for the same 2-rank
load, whichever load came first), so one timed read per round measured the order of the steps
more than the format.

* ``raw``: each rank writes, fsyncs, evicts and reads back one file of its share of the bytes
  in 64 MiB blocks (read into one reused buffer): the disk's sequential speed, the ceiling of
  any format.
* ``deepshard``: `deepshard.checkpoint.save` / ``load`` of ZeRO-style flat partitions (each
  rank's ``1/world`` of the flat fp32 master and moment buffers, `ShardMap.flat_buffer` maps,
  as ``ZeroOptimizer`` holds them), loaded into fresh buffers and checked equal, loaded again
  without checksums (to show what they cost); then the same save with ``async_save=True``,
  timing how long it blocks, once more with ``after=`` the first (a training run's later
  saves, which reuse the first one's host buffers), and a first save given the buffers
  ``prepare_async_save`` readied beforehand.
* ``deepspeed``: DeepSpeed 0.19.7 ZeRO-2 on its CPU accelerator, one AdamW step, then
  ``save_checkpoint`` / ``load_checkpoint`` (which writes the weights once more, as a module copy).
  Its ``torch.save`` never fsyncs: the save returns with the bytes still in the page cache, so a
  crash right after it can lose or tear the checkpoint. ``save_fsync_s`` adds the time to fsync
  what it wrote just after (``fsync_s``), the durable save on equal terms with the others.
* ``dcp``: FSDP2 (``fully_shard`` per layer and the root), one AdamW step, then
  ``torch.distributed.checkpoint.save`` / ``load`` of ``get_state_dict(model, optimizer)``
  (its ``FileSystemWriter`` fsyncs each file: ``sync_files=True`` by default).

Every report says whether its save fsyncs (``fsync``): raw, deepshard and dcp do, deepspeed not.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

BLOCK = 64 << 20
LOAD_TRIES = 2  # timed loads per round and competitor, each from an evicted cache


@dataclass(frozen=True)
class Shape:
    """The model: ``layers`` bias-free ``width x width`` linear layers."""

    width: int
    layers: int

    @property
    def params(self) -> int:
        """Number of parameters."""
        return self.width * self.width * self.layers


FULL = Shape(2048, 24)  # 100.7M parameters, 1.2 GB of fp32 weights + Adam moments
QUICK = Shape(96, 3)


@dataclass(frozen=True)
class RankJob:
    """What one rank runs."""

    competitor: str
    rank: int
    world: int
    port: int
    quick: bool
    folder: str
    out: str


def make_model(shape: Shape) -> torch.nn.Sequential:
    """The seeded model every competitor saves."""
    torch.manual_seed(0)
    return torch.nn.Sequential(
        *(torch.nn.Linear(shape.width, shape.width, bias=False) for _ in range(shape.layers))
    )


def _evict(folder: Path) -> None:
    for path in folder.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _fsync_all(folder: Path) -> None:
    for path in folder.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


def _timed_loads(folder: Path, fn: Any) -> dict[str, Any]:
    """``fn`` timed `LOAD_TRIES` times, ``folder`` evicted before each: the fastest and all."""
    tries = []
    for _ in range(LOAD_TRIES):
        _evict(folder)
        tries.append(_timed(fn))
    return {"load_s": min(tries), "load_tries_s": tries}


def _disk_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def _timed(fn: Any) -> float:
    dist.barrier()
    start = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - start


def _raw(job: RankJob, shape: Shape, folder: Path) -> dict[str, Any]:
    share = 12 * shape.params // job.world
    # Random bytes that never repeat: a file made of one block written over and over could be
    # deduplicated or compressed below the page cache (a virtual disk's host), and read back
    # faster than real tensor bytes would be.
    data = memoryview(os.urandom(share))
    path = folder / f"raw-{job.rank}.bin"

    def write() -> None:
        with open(path, "wb", buffering=0) as handle:
            done = 0
            while done < share:
                done += handle.write(data[done : done + BLOCK])
            os.fsync(handle.fileno())

    # Read into one reused, already touched buffer: ``handle.read(BLOCK)`` allocated a fresh
    # 64 MiB object per call, and its page faults (not the disk) set the row's load time
    # (4.2 s against 0.8 s for 600 MB read into touched memory, on the shared box).
    target = bytearray(min(BLOCK, max(share, 1)))

    def read() -> None:
        with open(path, "rb", buffering=0) as handle:
            while handle.readinto(target):
                pass

    save_s = _timed(write)
    loads = _timed_loads(folder, read)
    return {"save_s": save_s, **loads, "bytes": share * job.world, "fsync": True}


def _flat_state(model: torch.nn.Module, rank: int, world: int) -> dict[str, Any]:
    from deepshard.checkpoint import ShardedTensor
    from deepshard.interface import ShardMap

    params = dict(model.named_parameters())
    shapes = [tuple(p.shape) for p in params.values()]
    maps = ShardMap.flat_buffer(shapes, "float32", world_size=world)
    flat = torch.cat([p.detach().reshape(-1) for p in params.values()])
    size = -(-flat.numel() // world)
    buffers = {
        "master": flat[rank * size : (rank + 1) * size].clone(),
        "exp_avg": torch.randn(size, generator=torch.Generator().manual_seed(rank)),
        "exp_avg_sq": torch.rand(size, generator=torch.Generator().manual_seed(rank + 9)),
    }
    state: dict[str, Any] = {"optimizer/param_groups.0/step": torch.tensor(1.0)}
    for name, smap in zip(params, maps, strict=True):
        state[f"module/{name}"] = ShardedTensor(buffers["master"], smap, rank)
        for kind in ("exp_avg", "exp_avg_sq"):
            state[f"optimizer/{name}/{kind}"] = ShardedTensor(buffers[kind], smap, rank, False)
    return state


def _fresh(state: dict[str, Any]) -> dict[str, Any]:
    from deepshard.checkpoint import ShardedTensor

    locals_: dict[int, torch.Tensor] = {}
    out: dict[str, Any] = {}
    for key, value in state.items():
        if isinstance(value, ShardedTensor):
            # One buffer per shared local (not `setdefault(..., zeros_like(...))`, which
            # allocated and zeroed a whole flat buffer for each of the 72 entries: the 30-50 s
            # the "load without checksums" row used to show, timed inside it).
            if id(value.local) not in locals_:
                locals_[id(value.local)] = torch.zeros_like(value.local)
            local = locals_[id(value.local)]
            out[key] = ShardedTensor(local, value.shard_map, value.rank, value.linear)
        else:
            out[key] = torch.zeros_like(value)
    return out


def _deepshard(job: RankJob, shape: Shape, folder: Path) -> dict[str, Any]:
    from deepshard.checkpoint import load, prepare_async_save, save

    dist.init_process_group("gloo")
    state = _flat_state(make_model(shape), job.rank, job.world)
    save_s = _timed(lambda: save(state, folder / "sync", tag="t", group=None))
    like = _fresh(state)
    loads = _timed_loads(folder, lambda: load(folder / "sync", like, group=None))
    equal = all(
        torch.equal(getattr(like[k], "local", like[k]), getattr(v, "local", v))
        for k, v in state.items()
    )
    # Where load time goes: the same load without checking the SHA-256 of what it reads.
    like = _fresh(state)  # allocated outside the timing, as for the checked load
    unchecked = _timed_loads(folder, lambda: load(folder / "sync", like, verify_checksums=False))
    dist.barrier()
    start = time.perf_counter()
    handle = save(state, folder / "async", tag="t", group=None, async_save=True)
    blocking_s = time.perf_counter() - start
    handle.wait()
    async_total_s = time.perf_counter() - start
    dist.barrier()
    # A training run's later saves: given the previous handle, it reuses its host buffers.
    start = time.perf_counter()
    again = save(state, folder / "async", tag="t2", group=None, async_save=True, after=handle)
    steady_s = time.perf_counter() - start
    again.wait()
    del handle, again  # their host buffers
    # A first save whose buffers `prepare_async_save` readied while training ran (the wait
    # stands for that training; the engine prepares after its first optimizer step).
    prepared = prepare_async_save(state, group=None)
    prepared.wait()
    dist.barrier()
    start = time.perf_counter()
    first = save(state, folder / "async", tag="t3", group=None, async_save=True, after=prepared)
    prepared_s = time.perf_counter() - start
    first.wait()
    dist.barrier()
    return {
        "save_s": save_s,
        **loads,
        "bytes": _disk_bytes(folder / "sync"),
        "async_blocking_s": blocking_s,
        "async_total_s": async_total_s,
        "async_steady_blocking_s": steady_s,
        "async_prepared_blocking_s": prepared_s,
        "roundtrip_equal": equal,
        "load_unchecked_s": unchecked["load_s"],
        "fsync": True,
    }


def _one_step(model: torch.nn.Module, step: Any, width: int) -> None:
    loss = model(torch.randn(2, width, generator=torch.Generator().manual_seed(1))).pow(2).mean()
    step(loss)


def _deepspeed(job: RankJob, shape: Shape, folder: Path) -> dict[str, Any]:
    import deepspeed

    # Its CPU all-reduce op is JIT-built on every start (minutes); checkpoints never use it.
    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None  # type: ignore[attr-defined]
    deepspeed.init_distributed(dist_backend="gloo")
    model = make_model(shape)
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
        "zero_optimization": {"stage": 2},
    }
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=config
    )

    def step(loss: torch.Tensor) -> None:
        engine.backward(loss)
        engine.step()

    _one_step(engine, step, shape.width)
    save_s = _timed(lambda: engine.save_checkpoint(str(folder), tag="t", client_state={}))
    fsync_s = _timed(lambda: _fsync_all(folder))  # what a durable save would still wait for
    loads = _timed_loads(folder, lambda: engine.load_checkpoint(str(folder), tag="t"))
    return {
        "save_s": save_s,
        **loads,
        "bytes": _disk_bytes(folder / "t"),
        "fsync": False,
        "fsync_s": fsync_s,
        "save_fsync_s": save_s + fsync_s,
    }


def _dcp(job: RankJob, shape: Shape, folder: Path) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (job.world,))
    model = make_model(shape)
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step(loss: torch.Tensor) -> None:
        loss.backward()
        optimizer.step()

    _one_step(model, step, shape.width)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    save_s = _timed(lambda: dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=folder))

    def load() -> None:
        msd, osd = get_state_dict(model, optimizer)
        dcp.load({"model": msd, "optim": osd}, checkpoint_id=folder)
        set_state_dict(model, optimizer, model_state_dict=msd, optim_state_dict=osd)

    loads = _timed_loads(folder, load)
    return {"save_s": save_s, **loads, "bytes": _disk_bytes(folder), "fsync": True}


def _raw_entry(job: RankJob, shape: Shape, folder: Path) -> dict[str, Any]:
    dist.init_process_group("gloo")
    return _raw(job, shape, folder)


COMPETITORS = {"raw": _raw_entry, "deepshard": _deepshard, "deepspeed": _deepspeed, "dcp": _dcp}


def run_rank(job: RankJob) -> None:
    """Run ``job`` and write its report to ``job.out`` (its output to ``job.out``.log)."""
    fd = os.open(job.out + ".log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    for stream in (1, 2):
        os.dup2(fd, stream)
    os.close(fd)
    os.environ.update(
        RANK=str(job.rank),
        LOCAL_RANK=str(job.rank),
        WORLD_SIZE=str(job.world),
        LOCAL_WORLD_SIZE=str(job.world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(job.port),
    )
    torch.set_num_threads(1)
    shape = QUICK if job.quick else FULL
    folder = Path(job.folder)
    report = COMPETITORS[job.competitor](job, shape, folder)
    report["params"] = shape.params
    Path(job.out).write_text(json.dumps(report))
    dist.barrier()
    dist.destroy_process_group()
