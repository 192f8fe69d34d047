"""Run a function on N gloo ranks in subprocesses and collect what each returns.

The parent starts one process per rank from a forkserver that preloads torch (a fork of a warm
interpreter costs milliseconds; a fresh ``spawn`` re-imports torch in every rank), hands each a
pipe, and then waits on the pipes and the process sentinels together. The first failure wins:
a reported exception, or a process that exits without reporting. Any failure or the overall
deadline terminates every rank that is still alive, so no process outlives the call.

Importing this module imports neither torch nor ``deepshard.comm``: it is loaded by the pytest
plugin in every test session, including ones that check that torch is not imported.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import pickle
import shutil
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import TYPE_CHECKING, Any

from deepshard.testing._errors import MeshTimeoutError, RankFailedError, RendezvousFailedError
from deepshard.testing._function_ref import FunctionRef, function_ref
from deepshard.testing._rank_main import RankSpec, rank_main

if TYPE_CHECKING:
    from deepshard.interface import Topology

__all__ = ["run_on_mesh"]

# Modules every rank needs, imported once in the forkserver instead of once per rank. Slicing a
# mesh (``mesh["dp"]``) imports torch._dynamo, seconds per rank on a busy machine.
_PRELOAD = [
    "torch",
    "torch.distributed",
    "torch._dynamo",
    "torch.distributed.tensor",
    "deepshard.comm",
    "deepshard.testing._rank_main",
]
# Extra time after ``timeout_s`` before the parent gives up, so that a collective that timed
# out inside a rank is reported with its own traceback rather than as a bare deadline.
_GRACE_S = 3.0
# How many times a run whose gloo rendezvous failed is started (see run_on_mesh).
_RENDEZVOUS_ATTEMPTS = 3
# How long a terminated rank gets to exit before it is killed.
_TERMINATE_WAIT_S = 2.0


class _Rank:
    """The parent's handle on one rank: its process and the read end of its pipe."""

    def __init__(self, rank: int, process: BaseProcess, conn: Connection, log_path: str) -> None:
        self.rank = rank
        self.process = process
        self.conn = conn
        self.log_path = log_path


def _start_ranks(specs: list[RankSpec]) -> list[_Rank]:
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    ranks: list[_Rank] = []
    try:
        for spec in specs:
            reader, writer = ctx.Pipe(duplex=False)
            process = ctx.Process(
                target=rank_main, args=(spec, writer), name=f"deepshard-rank-{spec.rank}"
            )
            process.start()
            writer.close()  # the child holds the only write end, so its exit reads as EOF
            ranks.append(_Rank(spec.rank, process, reader, spec.log_path))
    except BaseException:
        _tear_down(ranks)
        raise
    return ranks


def _tear_down(ranks: list[_Rank]) -> None:
    for r in ranks:
        if r.process.is_alive():
            r.process.terminate()
    deadline = time.monotonic() + _TERMINATE_WAIT_S
    for r in ranks:
        r.process.join(max(0.0, deadline - time.monotonic()))
        if r.process.is_alive():
            r.process.kill()
            r.process.join()
        r.conn.close()
        r.process.close()


def _receive(r: _Rank) -> tuple[str, Any] | None:
    """The rank's message, or ``None`` if it closed its pipe (exited) without sending one."""
    try:
        message: tuple[str, Any] = r.conn.recv()
    except EOFError:
        return None
    return message


def _collect(ranks: list[_Rank], deadline: float, timeout_s: float) -> list[Any]:
    results: dict[int, Any] = {}
    pending = {r.rank: r for r in ranks}
    while pending:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise MeshTimeoutError(sorted(pending), timeout_s)
        # A pipe becomes readable with a message, or at EOF when its process has exited.
        ready = set(wait([r.conn for r in pending.values()], timeout=remaining))
        for rank in sorted(pending):
            r = pending[rank]
            if r.conn not in ready:
                continue
            message = _receive(r)
            if message is None:
                r.process.join(_TERMINATE_WAIT_S)
                raise RankFailedError(rank, exitcode=r.process.exitcode, child_traceback=None)
            status, body = message
            if status == "rendezvous-error":
                raise RendezvousFailedError(rank, exitcode=None, child_traceback=body)
            if status == "error":
                raise RankFailedError(rank, exitcode=None, child_traceback=body)
            results[rank] = pickle.loads(body)
            del pending[rank]
    return [results[rank] for rank in range(len(ranks))]


def _print_rank_output(ranks: list[_Rank]) -> None:
    for r in ranks:
        with contextlib.suppress(OSError):
            text = Path(r.log_path).read_text(errors="replace")
            if text:
                print(f"----- rank {r.rank} output -----\n{text}", file=sys.stderr, end="")


@contextlib.contextmanager
def _run_dir(store_dir: str | os.PathLike[str] | None) -> Iterator[Path]:
    if store_dir is not None:
        path = Path(store_dir) / f"run_on_mesh-{uuid.uuid4().hex[:12]}"
        path.mkdir(parents=True)
        yield path
        return
    path = Path(tempfile.mkdtemp(prefix="run_on_mesh-"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _check_arguments(world_size: int, topology: Topology | None, timeout_s: float) -> None:
    from deepshard.interface.errors import ConfigError

    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ConfigError(f"run_on_mesh: world_size must be an int >= 1, got {world_size!r}")
    if not timeout_s > 0:
        raise ConfigError(f"run_on_mesh: timeout_s must be > 0 seconds, got {timeout_s!r}")
    if topology is not None:
        topology.check_world(world_size)


def run_on_mesh(
    fn: Callable[..., Any],
    world_size: int,
    *,
    topology: Topology | None = None,
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    timeout_s: float = 120.0,
    store_dir: str | os.PathLike[str] | None = None,
) -> list[Any]:
    """Call ``fn(mesh, *args, **kwargs)`` on ``world_size`` gloo ranks; return their results.

    Each rank is a process forked from a forkserver with torch preloaded. It joins a gloo
    process group through a FileStore (no ports) whose timeout is ``timeout_s``, builds
    ``mesh = deepshard.comm.build_mesh(topology or Topology(dp=world_size))`` on CPU, and calls
    ``fn``. Inside ``fn`` the global rank is ``mesh.get_rank()``. Ranks see the caller's
    environment plus ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE`` and
    ``OMP_NUM_THREADS=1`` (unless set). What they print is echoed to stderr after the run.

    Args:
        fn: A module-level function (not a lambda or closure), in a test module or any module.
        world_size: Number of ranks.
        topology: The parallel layout; its world size must equal ``world_size``.
        args: Positional arguments after ``mesh``; pickled, so tensors and test-module
            objects are fine.
        kwargs: Keyword arguments for ``fn``.
        timeout_s: Timeout of every process group; the run is abandoned a few seconds later.
        store_dir: Directory for the FileStore and rank logs (a temporary one if ``None``).

    Returns:
        The value ``fn`` returned on each rank, in rank order; tensors come back on CPU.

    Raises:
        RankFailedError: A rank raised (its traceback is in the message) or died. A failure of
            gloo's rendezvous itself (before ``fn`` ran anywhere) is retried twice with a fresh
            store first.
        MeshTimeoutError: Some ranks did not finish in time (they are named).
        ConfigError: ``fn`` is not module-level, or an argument is out of range.
        TopologyError: ``topology`` does not fit ``world_size``.
    """
    _check_arguments(world_size, topology, timeout_s)
    ref = function_ref(fn)
    payload = pickle.dumps((tuple(args), dict(kwargs or {}), topology))
    for attempt in range(1, _RENDEZVOUS_ATTEMPTS + 1):
        try:
            return _run_once(ref, world_size, payload, timeout_s, store_dir)
        except RendezvousFailedError as error:
            # A gloo TCP handshake broken by the host (seen on loaded CI machines: "Connection
            # closed by peer" inside init_process_group). No test code has run yet, so a fresh
            # run with a new store is safe; a persistent failure still fails the test.
            if attempt == _RENDEZVOUS_ATTEMPTS:
                raise
            print(f"run_on_mesh: rendezvous failed ({error}); running again", file=sys.stderr)
    raise AssertionError("unreachable")  # pragma: no cover


def _run_once(
    ref: FunctionRef,
    world_size: int,
    payload: bytes,
    timeout_s: float,
    store_dir: str | os.PathLike[str] | None,
) -> list[Any]:
    env = dict(os.environ)
    with _run_dir(store_dir) as run_dir:
        specs = [
            RankSpec(
                rank=rank,
                world_size=world_size,
                fn=ref,
                payload=payload,
                store_path=str(run_dir / "store"),
                timeout_s=timeout_s,
                env=env,
                log_path=str(run_dir / f"rank{rank}.log"),
            )
            for rank in range(world_size)
        ]
        ranks = _start_ranks(specs)
        try:
            return _collect(ranks, time.monotonic() + timeout_s + _GRACE_S, timeout_s)
        finally:
            _tear_down(ranks)
            _print_rank_output(ranks)
