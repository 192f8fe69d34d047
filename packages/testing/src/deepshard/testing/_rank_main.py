"""What each rank process of `deepshard.testing.run_on_mesh` runs.

The process is forked from a forkserver that already imported torch, so start-up costs a fork,
not an interpreter plus a torch import. It adopts the parent's environment as it was at the call
(the forkserver's own is from whenever it started), joins a gloo process group through a
FileStore, builds the mesh, calls the function and sends one message back through its pipe:
``("ok", pickled result)`` or ``("error", formatted traceback)``. The error is sent before the
process group is torn down so that the parent can stop the other ranks straight away.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import pickle
import sys
import traceback
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Any

from deepshard.testing._function_ref import FunctionRef, resolve_function

__all__ = ["RankSpec", "rank_main"]


@dataclasses.dataclass(frozen=True)
class RankSpec:
    """Everything one rank needs, sent from the parent (all fields plain, picklable data).

    Attributes:
        rank: Global rank of this process.
        world_size: Number of ranks.
        fn: The module-level function to call as ``fn(mesh, *args, **kwargs)``.
        payload: ``pickle.dumps((args, kwargs, topology))``, unpickled only once ``fn``'s module
            is registered, so that objects defined in a test module resolve.
        store_path: The FileStore file shared by all ranks of this run.
        timeout_s: Timeout of every process group, in seconds.
        env: The parent's environment at the time of the call.
        log_path: File that receives this rank's stdout and stderr.
    """

    rank: int
    world_size: int
    fn: FunctionRef
    payload: bytes
    store_path: str
    timeout_s: float
    env: dict[str, str]
    log_path: str


def _redirect_output(log_path: str) -> None:
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def _flush_output() -> None:
    # The parent echoes the log as soon as the last result arrives: what the rank printed must
    # be in the file by then, not in Python's stdio buffers.
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()


def _adopt_environment(spec: RankSpec) -> None:
    import torch

    os.environ.clear()
    os.environ.update(spec.env)
    # Several ranks share few cores: one intra-op thread each unless the caller chose otherwise.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.update(
        RANK=str(spec.rank),
        WORLD_SIZE=str(spec.world_size),
        LOCAL_RANK=str(spec.rank),
        LOCAL_WORLD_SIZE=str(spec.world_size),
    )
    torch.set_num_threads(max(1, int(os.environ["OMP_NUM_THREADS"])))


def _to_cpu(result: Any) -> Any:
    import torch
    from torch.utils._pytree import tree_map_only

    return tree_map_only(torch.Tensor, lambda t: t.detach().to("cpu", copy=True), result)


def _run(spec: RankSpec) -> bytes:
    import torch.distributed as dist

    from deepshard.comm import build_mesh
    from deepshard.interface import Topology

    fn = resolve_function(spec.fn)
    args, kwargs, topology = pickle.loads(spec.payload)
    try:
        dist.init_process_group(
            "gloo",
            store=dist.FileStore(spec.store_path, spec.world_size),
            rank=spec.rank,
            world_size=spec.world_size,
            timeout=timedelta(seconds=spec.timeout_s),
        )
    except RuntimeError as error:
        raise RendezvousError(str(error)) from error
    mesh = build_mesh(topology or Topology(dp=spec.world_size), device_type="cpu")
    return pickle.dumps(_to_cpu(fn(mesh, *args, **kwargs)))


class RendezvousError(RuntimeError):
    """Gloo could not connect the ranks' default group (before the test body ran)."""


def _destroy_default_group() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def rank_main(spec: RankSpec, conn: Connection) -> None:
    """Run one rank and report its outcome through ``conn`` (the process's target).

    Raises:
        SystemExit: With code 1 after reporting an exception.
    """
    _redirect_output(spec.log_path)
    try:
        _adopt_environment(spec)
        data = _run(spec)
    except BaseException as error:
        _flush_output()
        status = "rendezvous-error" if isinstance(error, RendezvousError) else "error"
        conn.send((status, traceback.format_exc()))
        conn.close()
        _destroy_default_group()
        raise SystemExit(1) from None
    _destroy_default_group()
    _flush_output()
    conn.send(("ok", data))
    conn.close()
