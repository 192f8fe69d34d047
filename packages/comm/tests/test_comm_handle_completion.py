"""A CommHandle is complete only once its follow-up step has succeeded."""

from __future__ import annotations

import pytest
import torch

from deepshard.comm._handles import CommHandle


class _Work:
    """Stands in for a backend's pending `dist.Work`; counts its waits."""

    def __init__(self) -> None:
        self.waits = 0

    def wait(self) -> bool:
        self.waits += 1
        return True


class _FailsOnce:
    def __init__(self) -> None:
        self.calls = 0

    def __call__(self) -> None:
        self.calls += 1
        if self.calls == 1:
            raise RuntimeError("follow-up failed")


def test_a_failing_follow_up_is_not_skipped_by_a_later_wait() -> None:
    work, follow_up, out = _Work(), _FailsOnce(), torch.zeros(2)
    handle = CommHandle(out, work=work, on_complete=follow_up)  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="follow-up failed"):
        handle.wait()
    assert not handle.is_completed()
    assert handle.wait() is out  # runs the follow-up again, which now succeeds
    assert handle.is_completed()
    assert (follow_up.calls, work.waits) == (2, 1)  # the backend is waited on once
    handle.wait()
    assert follow_up.calls == 2  # once succeeded, never again


def test_a_failing_follow_up_of_a_sync_call_raises_at_once() -> None:
    follow_up = _FailsOnce()
    with pytest.raises(RuntimeError, match="follow-up failed"):
        CommHandle(torch.zeros(1), on_complete=follow_up)


def test_a_succeeding_follow_up_runs_once() -> None:
    calls: list[int] = []
    handle = CommHandle(None, work=_Work(), on_complete=lambda: calls.append(1))  # type: ignore[arg-type]
    assert not handle.is_completed()
    handle.wait()
    handle.wait()
    assert calls == [1] and handle.is_completed()
