"""Who is behind: the data each rank publishes about its collectives, and the hang report.

Every rank counts the collectives it issues on each process group (`seq`, 1-based, the same
order on every rank by the collective contract). A waiting rank at call `k` of group `G`
compares every other member's latest call on `G`:

* no call on `G` yet, or its latest is `< k`: **behind**, it never arrived (its current
  whereabouts come from its latest call on any group and, when it answered, its stack);
* call `k` with the same op, shape and dtype: **arrived** (waiting too, or done);
* call `k` of a different op, shape or dtype: **mismatch**, the ranks disagree on the order;
* a later call: **ahead** (e.g. the source of a broadcast may return early);
* nothing published at all: **silent** (its watchdog is off, or its process is gone).

Everything here is a function of plain data, so it is tested without processes.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from deepshard.interface.watchdog import format_watchdog_line

__all__ = [
    "CallInfo",
    "PeerStatus",
    "RankState",
    "classify_peers",
    "format_report",
    "stuck_ranks",
]

Status = Literal["behind", "arrived", "mismatch", "ahead", "silent"]
_STUCK: frozenset[str] = frozenset({"behind", "mismatch", "silent"})
_MAX_PEER_LINES = 8


@dataclasses.dataclass(frozen=True)
class CallInfo:
    """One collective as a rank saw it."""

    group: str
    """The process group's name (`ProcessGroup.group_name`), the same on every member."""
    seq: int
    """1-based position of this call among the collectives this rank issued on `group`."""
    op: str
    """The collective, e.g. `"all_reduce"`."""
    shape: tuple[int, ...] | None
    """The input tensor's shape (`None` for a barrier)."""
    dtype: str | None
    """The input tensor's dtype without the `torch.` prefix (`None` for a barrier)."""
    site: str
    """Where it was called: `file:line in function`, innermost caller outside deepshard.comm
    first, then the first caller outside deepshard (`<-` between them)."""
    age_s: float
    """Seconds since it was issued, when the record was taken."""
    done: bool
    """Whether it had completed when the record was taken."""

    def signature(self) -> tuple[str, tuple[int, ...] | None, str | None]:
        """What every member of the group must agree on for the same `seq`."""
        return self.op, self.shape, self.dtype

    def describe(self) -> str:
        """E.g. `all_reduce #3 (float32[4, 2])`."""
        if self.shape is None:
            return f"{self.op} #{self.seq}"
        dims = ", ".join(str(d) for d in self.shape)
        return f"{self.op} #{self.seq} ({self.dtype}[{dims}])"

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (`from_json` reads it back)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> CallInfo:
        """The inverse of `to_json`.

        Raises:
            KeyError, TypeError, ValueError: `data` is not such a record.
        """
        shape = data["shape"]
        return cls(
            group=str(data["group"]),
            seq=int(data["seq"]),
            op=str(data["op"]),
            shape=None if shape is None else tuple(int(d) for d in shape),
            dtype=None if data["dtype"] is None else str(data["dtype"]),
            site=str(data["site"]),
            age_s=float(data["age_s"]),
            done=bool(data["done"]),
        )


@dataclasses.dataclass(frozen=True)
class RankState:
    """What one rank published: its latest call on every group, and where it is now."""

    rank: int
    """Global rank."""
    calls: tuple[CallInfo, ...] = ()
    """The latest call on each group this rank has used."""
    stack: tuple[str, ...] = ()
    """Innermost frames of the thread that issues its collectives, when asked for them."""
    taken_at: float = 0.0
    """Wall-clock time (`time.time()`) when the ages in `calls` were taken."""

    def aged(self, now: float) -> RankState:
        """The same record with every age advanced to wall-clock time `now`."""
        delta = max(0.0, now - self.taken_at)
        calls = tuple(dataclasses.replace(c, age_s=c.age_s + delta) for c in self.calls)
        return dataclasses.replace(self, calls=calls, taken_at=max(now, self.taken_at))

    def latest_on(self, group: str) -> CallInfo | None:
        """The latest call on `group`, if any."""
        return next((call for call in self.calls if call.group == group), None)

    def latest(self) -> CallInfo | None:
        """The most recently issued call on any group, if any."""
        return min(self.calls, key=lambda call: call.age_s, default=None)

    def to_json(self) -> str:
        """The record as a JSON string (`from_json` reads it back)."""
        calls = [call.to_json() for call in self.calls]
        data = {"rank": self.rank, "calls": calls, "stack": list(self.stack), "at": self.taken_at}
        return json.dumps(data)

    @classmethod
    def from_json(cls, text: str | bytes) -> RankState | None:
        """The inverse of `to_json`; `None` for anything that is not such a record."""
        try:
            data = json.loads(text)
            calls = tuple(CallInfo.from_json(call) for call in data["calls"])
            stack = tuple(str(s) for s in data.get("stack", ()))
            return cls(int(data["rank"]), calls, stack, float(data.get("at", 0.0)))
        except (KeyError, TypeError, ValueError, AttributeError):
            return None


@dataclasses.dataclass(frozen=True)
class PeerStatus:
    """Where one other member of the group stands relative to the waiting call."""

    rank: int
    """Global rank."""
    status: Status
    """See the module docstring."""
    detail: str
    """One line saying what it was last seen doing."""


def _whereabouts(state: RankState, group: str) -> str:
    parts = []
    on_group = state.latest_on(group)
    if on_group is None:
        parts.append("no collective on this group yet")
    else:
        parts.append(f"last here: {_call_text(on_group)}")
    latest = state.latest()
    if latest is not None and latest is not on_group:
        parts.append(f"latest anywhere: {_call_text(latest)} on group {latest.group}")
    if state.stack:
        parts.append(f"now at: {' <- '.join(reversed(state.stack))}")
    return "; ".join(parts)


def _call_text(call: CallInfo) -> str:
    state = "completed" if call.done else f"waiting {call.age_s:.1f} s"
    return f"{call.describe()} at {call.site}, issued {call.age_s:.1f} s ago, {state}"


def classify_peers(
    waiting: CallInfo,
    members: Sequence[int],
    self_rank: int,
    states: Mapping[int, RankState | None],
) -> list[PeerStatus]:
    """Every other member's status relative to `waiting` (see the module docstring).

    Args:
        waiting: The call this rank is waiting in.
        members: The global ranks of its group.
        self_rank: This rank (skipped).
        states: What each member published (`None` or missing: nothing readable).
    """
    peers = []
    for rank in members:
        if rank == self_rank:
            continue
        state = states.get(rank)
        if state is None:
            peers.append(PeerStatus(rank, "silent", "published no watchdog record"))
            continue
        call = state.latest_on(waiting.group)
        if call is None or call.seq < waiting.seq:
            status: Status = "behind"
        elif call.seq > waiting.seq:
            status = "ahead"
        elif call.signature() == waiting.signature():
            status = "arrived"
        else:
            status = "mismatch"
        peers.append(PeerStatus(rank, status, _whereabouts(state, waiting.group)))
    return peers


def stuck_ranks(peers: Sequence[PeerStatus]) -> list[int]:
    """The ranks that keep the waiting call from completing."""
    return [peer.rank for peer in peers if peer.status in _STUCK]


def format_report(
    rank: int,
    waiting: CallInfo,
    waited_s: float,
    members: Sequence[int],
    peers: Sequence[PeerStatus],
) -> str:
    """The hang report: a summary line (`deepshard.interface.watchdog`), then one line per
    member that has not arrived (at most 8, then a count), arrived members counted.

    Args:
        rank: The waiting rank.
        waiting: Its call.
        waited_s: How long it waited.
        members: The group's global ranks.
        peers: `classify_peers`'s answer.
    """
    stuck = stuck_ranks(peers)
    if not stuck:  # everyone arrived, yet the call did not complete: the backend is stuck
        stuck = [peer.rank for peer in peers if peer.status != "arrived"] or [rank]
    ranks = ", ".join(str(r) for r in members)
    what = (
        f"waited {waited_s:.1f} s in {waiting.describe()} on group {waiting.group} "
        f"(ranks {ranks}) at {waiting.site}"
    )
    lines = [format_watchdog_line(rank, what, stuck)]
    shown = [peer for peer in peers if peer.status != "arrived"]
    for peer in shown[:_MAX_PEER_LINES]:
        lines.append(f"  rank {peer.rank} {peer.status}: {peer.detail}")
    if len(shown) > _MAX_PEER_LINES:
        lines.append(f"  ... and {len(shown) - _MAX_PEER_LINES} more ranks not shown")
    arrived = [peer.rank for peer in peers if peer.status == "arrived"]
    if arrived:
        lines.append(f"  arrived and waiting too: {len(arrived)} rank(s)")
    return "\n".join(lines)
