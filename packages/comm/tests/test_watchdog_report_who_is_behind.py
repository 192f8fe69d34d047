"""The watchdog's "who is behind" logic, its report and its records, without processes."""

from __future__ import annotations

import threading
import time

import pytest
import torch
import torch.distributed as dist

from deepshard.comm import CommWatchdog
from deepshard.comm._watchdog_report import (
    CallInfo,
    RankState,
    classify_peers,
    format_report,
    stuck_ranks,
)
from deepshard.comm.watchdog import WatchedCall, _GroupTrack
from deepshard.interface.errors import CommError, ConfigError
from deepshard.interface.watchdog import (
    DEFAULT_WATCHDOG_S,
    format_watchdog_line,
    parse_watchdog_line,
    resolve_watchdog_s,
)


def _call(
    seq: int, op: str = "all_reduce", shape: tuple[int, ...] = (4,), **kw: object
) -> CallInfo:
    fields: dict[str, object] = {
        "group": "0",
        "seq": seq,
        "op": op,
        "shape": shape,
        "dtype": "float32",
        "site": "train.py:10 in step",
        "age_s": 1.0,
        "done": False,
    }
    fields.update(kw)
    return CallInfo(**fields)  # type: ignore[arg-type]


WAITING = _call(5)


def test_each_member_is_classified_against_the_waiting_call() -> None:
    states = {
        1: RankState(1, (_call(4, done=True),)),  # one call short
        2: RankState(2, (_call(5),)),  # the same call
        3: RankState(3, (_call(5, op="broadcast"),)),  # another op at the same position
        4: RankState(4, (_call(5, shape=(8,)),)),  # another shape
        5: RankState(5, (_call(6),)),  # already past it
        6: RankState(6, (_call(9, group="7"),)),  # never used this group
        7: None,  # published nothing
    }
    peers = classify_peers(WAITING, list(range(9)), 0, states)
    got = {peer.rank: peer.status for peer in peers}
    assert got == {
        1: "behind",
        2: "arrived",
        3: "mismatch",
        4: "mismatch",
        5: "ahead",
        6: "behind",
        7: "silent",
        8: "silent",  # missing from the mapping
    }
    assert stuck_ranks(peers) == [1, 3, 4, 6, 7, 8]
    detail = {peer.rank: peer.detail for peer in peers}
    assert "last here: all_reduce #4 (float32[4]) at train.py:10 in step" in detail[1]
    assert "completed" in detail[1]
    assert detail[6].startswith("no collective on this group yet; latest anywhere: all_reduce #9")


def test_the_report_names_the_stuck_ranks_in_a_line_the_launcher_reads_back() -> None:
    stack = ("train.py:30 in main: step()", "train.py:12 in step: time.sleep(60)")
    states = {1: RankState(1, (_call(4, done=True),), stack), 2: RankState(2, (_call(5),))}
    peers = classify_peers(WAITING, [0, 1, 2], 0, states)
    report = format_report(0, WAITING, 3.04, [0, 1, 2], peers)
    lines = report.splitlines()
    summary = parse_watchdog_line(lines[0])
    assert summary is not None and summary.rank == 0 and summary.stuck == (1,)
    assert "waited 3.0 s in all_reduce #5 (float32[4]) on group 0 (ranks 0, 1, 2)" in summary.what
    assert summary.what.endswith("at train.py:10 in step")
    assert lines[1].startswith("  rank 1 behind: last here: all_reduce #4")
    # innermost frame first
    assert lines[1].endswith(
        "now at: train.py:12 in step: time.sleep(60) <- train.py:30 in main: step()"
    )
    assert lines[2] == "  arrived and waiting too: 1 rank(s)"
    assert len(lines) == 3


def test_a_large_group_is_summarized_not_listed() -> None:
    members = list(range(40))
    peers = classify_peers(WAITING, members, 0, {})
    lines = format_report(0, WAITING, 2.0, members, peers).splitlines()
    assert len(lines) == 1 + 8 + 1
    assert lines[-1] == "  ... and 31 more ranks not shown"
    summary = parse_watchdog_line(lines[0])
    assert summary is not None and summary.stuck == tuple(range(1, 17)) and summary.more == 23


def test_records_round_trip_through_json_and_age_on_reading() -> None:
    state = RankState(
        3, (_call(2, shape=(2, 3)), _call(1, group="5", done=True)), ("a:1 in f",), 100.0
    )
    again = RankState.from_json(state.to_json())
    assert again == state
    aged = state.aged(102.5)
    assert [c.age_s for c in aged.calls] == [3.5, 3.5] and aged.taken_at == 102.5
    assert (
        RankState(0, (CallInfo("0", 1, "barrier", None, None, "x", 0.0, True),)).calls[0].describe()
        == "barrier #1"
    )
    for garbage in ("", "{}", "[1]", '{"rank": 0, "calls": [{"seq": 1}]}', b"\xff"):
        assert RankState.from_json(garbage) is None


def test_the_marker_line_is_found_behind_prefixes_and_ignored_elsewhere() -> None:
    line = format_watchdog_line(2, "waited 3.0 s in barrier #1", [0, 5])
    assert line.endswith("not arrived: ranks 0, 5")
    for text in (line, f"[rank 2] {line}", f"deepshard.interface.errors.CommError: {line}"):
        parsed = parse_watchdog_line(text)
        assert parsed is not None and (parsed.rank, parsed.stuck) == (2, (0, 5))
    assert parse_watchdog_line("[deepshard watchdog] something else") is None
    assert parse_watchdog_line("an ordinary line") is None


def test_the_watchdog_time_comes_from_config_then_env_then_default() -> None:
    assert resolve_watchdog_s(None, {}) == DEFAULT_WATCHDOG_S == 120.0
    assert resolve_watchdog_s(None, {"DEEPSHARD_WATCHDOG_S": "7.5"}) == 7.5
    assert resolve_watchdog_s(30, {"DEEPSHARD_WATCHDOG_S": "7.5"}) == 30.0
    assert resolve_watchdog_s(None, {"DEEPSHARD_WATCHDOG_S": "0"}) is None
    assert resolve_watchdog_s(0, {}) is None
    for bad in ("soon", "-1", "inf", "nan"):
        with pytest.raises(ConfigError, match="DEEPSHARD_WATCHDOG_S"):
            resolve_watchdog_s(None, {"DEEPSHARD_WATCHDOG_S": bad})


class _HangingWork:
    """A backend work that never completes: its timed wait raises like gloo's."""

    def get_future(self) -> None:
        return None

    def wait(self, timeout: object = None) -> bool:
        time.sleep(timeout.total_seconds())  # type: ignore[attr-defined]
        raise RuntimeError("Operation timed out!")


class _BrokenWork(_HangingWork):
    def wait(self, timeout: object = None) -> bool:
        raise RuntimeError("Connection closed by peer")


class _WrapperWork:
    """Like gloo's reduce_scatter work: no future, and a wait that ignores any timeout."""

    def __init__(self, error: str | None = None, hang: bool = False) -> None:
        self.error, self.hang, self.release = error, hang, threading.Event()

    def get_future(self) -> None:
        raise RuntimeError("Work::getFuture not implemented.")

    def wait(self, timeout: object = None) -> bool:
        if self.hang:
            self.release.wait()
        if self.error:
            raise RuntimeError(self.error)
        return True


def _watched(track: _GroupTrack) -> WatchedCall:
    return WatchedCall(
        track, "all_reduce", torch.ones(2, dtype=torch.bfloat16), (), time.monotonic()
    )


def test_a_timed_out_wait_raises_the_report_and_a_backend_error_passes_through() -> None:
    store = dist.HashStore()
    dog = CommWatchdog(0.3, store=store, rank=0, grace_s=0.2)
    peer = CommWatchdog(0.3, store=store, rank=1)  # publishes, but never used the group
    try:
        track = _GroupTrack("g", (0, 1, 2))
        start = time.monotonic()
        with pytest.raises(CommError) as caught:
            dog.wait(_HangingWork(), _watched(track))  # type: ignore[arg-type]
        assert time.monotonic() - start < 0.3 + 0.2 + 1.0
        lines = str(caught.value).splitlines()
        summary = parse_watchdog_line(lines[0])
        assert summary is not None and summary.stuck == (1, 2)
        assert "all_reduce #1 (bfloat16[2]) on group g" in summary.what
        assert lines[1].startswith("  rank 1 behind: no collective on this group yet")
        assert lines[2] == "  rank 2 silent: published no watchdog record"
        with pytest.raises(RuntimeError, match="Connection closed by peer"):
            dog.wait(_BrokenWork(), _watched(track))  # type: ignore[arg-type]

        # A work whose wait ignores timeouts is waited for on a helper thread.
        done = _watched(track)
        dog.wait(_WrapperWork(), done)  # type: ignore[arg-type]
        assert done.done
        with pytest.raises(RuntimeError, match="gloo failed"):
            dog.wait(_WrapperWork(error="gloo failed"), _watched(track))  # type: ignore[arg-type]
        hung = _WrapperWork(hang=True)
        start = time.monotonic()
        with pytest.raises(CommError, match=r"reduce|all_reduce #5 \(bfloat16\[2\]\)"):
            dog.wait(hung, _watched(track))  # type: ignore[arg-type]
        assert 0.3 <= time.monotonic() - start < 0.3 + 0.2 + 1.0
        hung.release.set()
    finally:
        dog.close()
        peer.close()


def test_bad_times_are_refused() -> None:
    with pytest.raises(ConfigError, match="comms_watchdog_s"):
        CommWatchdog(0, store=dist.HashStore(), rank=0)
    with pytest.raises(ConfigError, match="interval_s"):
        CommWatchdog(1, store=dist.HashStore(), rank=0, interval_s=0)
