"""The comms watchdog: a rank stuck in a collective says who has not arrived, then fails.

Without it, a rank that never reaches a collective leaves the others waiting for the whole
process-group timeout (10 minutes), after which gloo blames the *waiting* rank. With a
`CommWatchdog` passed to the collectives (`watchdog=`, or carried by the `CommsLogger` that
ZeRO and the engine already thread through), a rank waits at most `timeout_s`, then:

1. it asks every rank of the group, through the rendezvous store, where it is;
2. it reads what each one published: its latest collective per group (op, shape, dtype,
   call site, sequence number) and, when it answers in time, the stack of its calling thread;
3. it raises `CommError` with a report whose first line (`deepshard.interface.watchdog`)
   names the ranks that have not arrived, which `ds-launch` picks out of the output.

The hot path touches no store and takes no lock: a call records a small object in memory
(sequence number, op, shape, the caller's code object and line) and waits with a timeout. A
daemon thread per rank publishes the latest records every `interval_s` when they changed, and
answers the stack requests of waiting ranks. Publishing on demand only would not work: the
stuck rank is by definition not in a collective, so only its own thread can speak for it.

The timed wait is a host wait. gloo blocks there; NCCL and XCCL complete a host wait as soon as
the work is queued on the device, so on those backends this watchdog does not see a device-side
hang (PyTorch's NCCL watchdog and flight recorder do; see `TORCH_NCCL_TRACE_BUFFER_SIZE`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import threading
import time
import traceback
import weakref
from datetime import timedelta
from types import CodeType, FrameType

import torch
import torch.distributed as dist

from deepshard.comm._bounded_wait import BlockingWaiter, honours_timeout
from deepshard.comm._watchdog_report import CallInfo, RankState, classify_peers, format_report
from deepshard.interface.errors import CommError, ConfigError

__all__ = ["CommWatchdog", "WatchedCall"]

_PREFIX = "deepshard_watchdog"
_STACK_FRAMES = 4
_NOT_USER_CODE = ("deepshard.", "torch.")


class _GroupTrack:
    """Per process group: its cross-rank name, members and the latest call issued on it."""

    __slots__ = ("latest", "members", "name", "seq")

    def __init__(self, name: str, members: tuple[int, ...]) -> None:
        self.name = name
        self.members = members
        self.seq = 0
        self.latest: WatchedCall | None = None


class WatchedCall:
    """One collective as the watchdog tracks it (made by `CommWatchdog.begin`)."""

    __slots__ = ("done", "dtype", "op", "seq", "shape", "sites", "started", "track")

    def __init__(
        self,
        track: _GroupTrack,
        op: str,
        tensor: torch.Tensor | None,
        sites: tuple[tuple[CodeType, int], ...],
        started: float,
    ) -> None:
        track.seq += 1
        self.track, self.seq, self.op, self.sites, self.started = (
            track,
            track.seq,
            op,
            sites,
            started,
        )
        self.shape = None if tensor is None else tuple(tensor.shape)
        self.dtype = None if tensor is None else str(tensor.dtype).removeprefix("torch.")
        self.done = False

    def info(self, now: float) -> CallInfo:
        """The call as published data, its age taken at `now`."""
        site = " <- ".join(
            f"{_short_path(code.co_filename)}:{line} in {code.co_name}" for code, line in self.sites
        )
        return CallInfo(
            self.track.name,
            self.seq,
            self.op,
            self.shape,
            self.dtype,
            site or "<unknown>",
            max(0.0, now - self.started),
            self.done,
        )


def _short_path(path: str) -> str:
    parts = path.replace(os.sep, "/").split("/")
    return "/".join(parts[-2:])


def _call_sites() -> tuple[tuple[CodeType, int], ...]:
    """The innermost caller outside deepshard.comm, and the first one that is the user's own
    (outside deepshard and torch: a ZeRO hook runs under autograd's frames)."""
    frame: FrameType | None = sys._getframe(2)
    sites: list[tuple[CodeType, int]] = []
    for _ in range(60):  # a bounded walk
        if frame is None:
            break
        module = frame.f_globals.get("__name__", "")
        if not module.startswith("deepshard.comm"):
            if not sites:
                sites.append((frame.f_code, frame.f_lineno))
            if not module.startswith(_NOT_USER_CODE):
                if sites[0][0] is not frame.f_code:
                    sites.append((frame.f_code, frame.f_lineno))
                break
        frame = frame.f_back
    return tuple(sites)


class CommWatchdog:
    """Bounds every watched collective's wait to `timeout_s`, then reports the hang.

    Create one per process after the default process group exists and pass it to the
    collectives (`watchdog=`) or to the `CommsLogger` that carries it to them. Every rank of a
    job should have one (a rank without one is reported as "silent"), with the same timeout.

    Args:
        timeout_s: Seconds a rank may wait in one collective.
        store: Where ranks publish their records: a store shared by every rank (the default
            group's rendezvous store when `None`).
        rank: This process's global rank (the default group's rank when `None`).
        interval_s: How often the thread publishes and looks for requests; `timeout_s / 4`
            clamped to [0.25, 5] s when `None`.
        grace_s: How long a waiting rank waits for answers once it times out;
            `interval_s + 1` when `None`.

    Raises:
        ConfigError: A time is not positive.
        CommError: No store was given and there is no default process group.
    """

    def __init__(
        self,
        timeout_s: float,
        *,
        store: dist.Store | None = None,
        rank: int | None = None,
        interval_s: float | None = None,
        grace_s: float | None = None,
    ) -> None:
        if not timeout_s > 0:
            raise ConfigError(
                f"comms_watchdog_s must be > 0 to watch (0 means off), got {timeout_s}"
            )
        self.timeout_s = float(timeout_s)
        self.interval_s = (
            interval_s if interval_s is not None else min(5.0, max(0.25, timeout_s / 4))
        )
        self.grace_s = grace_s if grace_s is not None else self.interval_s + 1.0
        if not (self.interval_s > 0 and self.grace_s > 0):
            raise ConfigError(
                f"CommWatchdog interval_s and grace_s must be > 0, got {interval_s}, {grace_s}"
            )
        if (store is None or rank is None) and not dist.is_initialized():
            raise CommError(
                "CommWatchdog needs the default process group (call "
                "deepshard.comm.init_distributed first) or an explicit store= and rank="
            )
        self.rank = dist.get_rank() if rank is None else rank
        base = dist.distributed_c10d._get_default_store() if store is None else store
        self._store = dist.PrefixStore(_PREFIX, base)
        self._wait_timeout = timedelta(seconds=self.timeout_s)
        self._blocking = BlockingWaiter()
        weakref.finalize(self, self._blocking.close)
        self._tracks: dict[dist.ProcessGroup, _GroupTrack] = {}
        self._lock = threading.Lock()
        self._caller_thread = threading.get_ident()
        self._stop = threading.Event()
        self._published: str | None = None
        self._answered = 0
        # The thread holds the watchdog weakly: a dropped watchdog ends its thread.
        self._thread = threading.Thread(
            target=_publish_loop,
            args=(weakref.ref(self), self._stop, self.interval_s),
            name="deepshard-comms-watchdog",
            daemon=True,
        )
        self._thread.start()
        # A daemon thread still inside a C++ call (a store operation) when the interpreter
        # finalizes is ended by pthread_exit, whose forced unwinding through pybind11's noexcept
        # GIL guards calls std::terminate: the rank dies with SIGABRT ("terminate called without
        # an active exception") after its work is done. weakref.finalize also runs at exit,
        # before finalization, so the thread is stopped and joined there (or when dropped).
        self._stop_thread = weakref.finalize(
            self, _stop_and_join, self._stop, self._thread, self.interval_s + 5.0
        )

    # ---- the hot path -------------------------------------------------------------------

    def begin(self, op: str, pg: dist.ProcessGroup, tensor: torch.Tensor | None) -> WatchedCall:
        """Record a collective about to be issued on `pg` (its input `tensor`)."""
        track = self._tracks.get(pg)
        if track is None:
            with self._lock:
                members = tuple(dist.get_process_group_ranks(pg))
                track = self._tracks.setdefault(pg, _GroupTrack(str(pg.group_name), members))
        self._caller_thread = threading.get_ident()
        call = WatchedCall(track, op, tensor, _call_sites(), time.monotonic())
        track.latest = call
        return call

    def wait(self, work: dist.Work, call: WatchedCall) -> None:
        """Wait for `work` at most `timeout_s`; mark `call` done.

        Raises:
            CommError: The wait timed out; the message is the hang report.
        """
        start = time.monotonic()
        try:
            if honours_timeout(work):
                work.wait(self._wait_timeout)
            elif not self._blocking.wait(work, self.timeout_s):
                waited = time.monotonic() - start
                raise CommError(self.report(call, waited) + _advice(self.timeout_s))
        except RuntimeError as error:
            waited = time.monotonic() - start
            if waited < 0.99 * self.timeout_s:  # a real backend error, not our timeout
                raise
            raise CommError(self.report(call, waited) + _advice(self.timeout_s)) from error
        call.done = True

    # ---- the report ---------------------------------------------------------------------

    def report(self, call: WatchedCall, waited_s: float) -> str:
        """The hang report for `call`, after asking its group where every member is."""
        waiting = call.info(time.monotonic())
        members = call.track.members
        with contextlib.suppress(Exception):  # a gone store leaves the peers "silent"
            self._store.set(f"state/{self.rank}", self._snapshot().to_json())
        try:
            request = int(self._store.add("request", 1))
        except Exception:
            request = -1
        states = self._read_states(members)
        peers = classify_peers(waiting, members, self.rank, states)
        deadline = time.monotonic() + self.grace_s
        waiting_for = {peer.rank for peer in peers if peer.status in ("behind", "mismatch")}
        while request > 0 and waiting_for and time.monotonic() < deadline:
            time.sleep(0.05)
            for rank in list(waiting_for):
                stack = self._read_stack(rank, request)
                state = states.get(rank)
                if stack is not None and state is not None:
                    states[rank] = dataclasses.replace(state, stack=stack)
                    waiting_for.discard(rank)
        fresh = self._read_states(members)  # a straggler may have published meanwhile
        for rank, state in fresh.items():
            old = states.get(rank)
            if state is not None:
                states[rank] = dataclasses.replace(state, stack=old.stack if old else ())
        peers = classify_peers(waiting, members, self.rank, states)
        return format_report(self.rank, waiting, waited_s, members, peers)

    def _read(self, key: str) -> bytes | None:
        try:
            if not self._store.check([key]):
                return None
            return bytes(self._store.get(key))
        except Exception:  # the store's host is gone: nothing to read
            return None

    def _read_states(self, members: tuple[int, ...]) -> dict[int, RankState | None]:
        out: dict[int, RankState | None] = {}
        for rank in members:
            if rank != self.rank:
                raw = self._read(f"state/{rank}")
                state = None if raw is None else RankState.from_json(raw)
                out[rank] = None if state is None else state.aged(time.time())
        return out

    def _read_stack(self, rank: int, request: int) -> tuple[str, ...] | None:
        raw = self._read(f"stack/{rank}")
        if raw is None:
            return None
        answer, _, text = raw.decode(errors="replace").partition("\n")
        if not answer.isdigit() or int(answer) < request:
            return None
        return tuple(text.split("\n")) if text else ()

    # ---- the publishing thread ----------------------------------------------------------

    def _snapshot(self) -> RankState:
        now = time.monotonic()
        with self._lock:
            tracks = list(self._tracks.values())
        calls = tuple(t.latest.info(now) for t in tracks if t.latest is not None)
        return RankState(self.rank, calls, taken_at=time.time())

    def _tick(self) -> None:
        # Ages change every tick; publish when a call started or finished, not for that.
        state = self._snapshot()
        key = repr([(c.group, c.seq, c.done) for c in state.calls])
        if key != self._published:
            self._store.set(f"state/{self.rank}", state.to_json())
            self._published = key
        request = int(self._store.add("request", 0))
        if request > self._answered:
            self._store.set(f"stack/{self.rank}", f"{request}\n" + "\n".join(self._stack()))
            self._answered = request

    def _stack(self) -> list[str]:
        frame = sys._current_frames().get(self._caller_thread)
        if frame is None:
            return []
        frames = traceback.extract_stack(frame)[-_STACK_FRAMES:]
        return [
            f"{_short_path(f.filename)}:{f.lineno} in {f.name}" + (f": {f.line}" if f.line else "")
            for f in frames
        ]

    def close(self) -> None:
        """Stop the publishing thread (idempotent); collectives may still use `wait`."""
        self._stop_thread()


def _stop_and_join(stop: threading.Event, thread: threading.Thread, timeout_s: float) -> None:
    stop.set()
    if thread is not threading.current_thread():
        thread.join(timeout=timeout_s)


def _publish_loop(
    ref: weakref.ReferenceType[CommWatchdog], stop: threading.Event, interval_s: float
) -> None:
    # The first record goes out at once, so that a rank with no collective yet reads as
    # "behind" rather than "silent".
    while not stop.is_set():
        dog = ref()
        if dog is None:
            return
        try:
            dog._tick()
        except Exception:  # the store went away (rank 0 exited): stop publishing
            return
        del dog
        stop.wait(interval_s)


def _advice(timeout_s: float) -> str:
    return (
        f"\nThis rank stopped after {timeout_s:g} s instead of waiting out the process-group "
        "timeout (DEEPSHARD_TIMEOUT). Fix what keeps the ranks named above from the collective "
        "(a rank-dependent branch, a crash, a slow step), or raise comms_watchdog_s / "
        "DEEPSHARD_WATCHDOG_S if such a wait is legitimate (0 turns the watchdog off)."
    )
