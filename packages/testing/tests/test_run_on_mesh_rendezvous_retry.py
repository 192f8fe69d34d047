"""A gloo rendezvous that fails before the test body ran is retried; anything else is not."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import pytest

from deepshard.testing import _run_on_mesh
from deepshard.testing._errors import RankFailedError, RendezvousFailedError
from deepshard.testing._function_ref import function_ref
from deepshard.testing._rank_main import RankSpec, RendezvousError, _run


def _body(mesh: object) -> int:
    return 7


def _fake_run_once(failures: list[BaseException]) -> Any:
    calls: list[int] = []

    def run_once(*args: object) -> list[int]:
        calls.append(1)
        if failures:
            raise failures.pop(0)
        return [7]

    run_once.calls = calls  # type: ignore[attr-defined]
    return run_once


def _rendezvous_failure() -> RendezvousFailedError:
    return RendezvousFailedError(1, exitcode=None, child_traceback="Connection closed by peer")


def test_a_failed_rendezvous_is_run_again(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = _fake_run_once([_rendezvous_failure(), _rendezvous_failure()])
    monkeypatch.setattr(_run_on_mesh, "_run_once", fake)
    assert _run_on_mesh.run_on_mesh(_body, 2) == [7]
    assert len(fake.calls) == 3


def test_a_persistent_rendezvous_failure_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = _fake_run_once([_rendezvous_failure() for _ in range(3)])
    monkeypatch.setattr(_run_on_mesh, "_run_once", fake)
    with pytest.raises(RendezvousFailedError, match="Connection closed by peer"):
        _run_on_mesh.run_on_mesh(_body, 2)
    assert len(fake.calls) == 3


def test_a_failure_of_the_test_body_is_not_retried(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = _fake_run_once([RankFailedError(0, exitcode=None, child_traceback="boom")])
    monkeypatch.setattr(_run_on_mesh, "_run_once", fake)
    with pytest.raises(RankFailedError, match="boom"):
        _run_on_mesh.run_on_mesh(_body, 2)
    assert len(fake.calls) == 1


def test_a_rank_reports_an_init_failure_as_a_rendezvous_error(tmp_path: Path) -> None:
    # Rank 0 of 2 whose peer never comes: gloo's rendezvous times out inside
    # init_process_group, which the rank reports as a rendezvous failure (retryable), not as
    # a failure of the test body.
    spec = RankSpec(
        rank=0,
        world_size=2,
        fn=function_ref(_body),
        payload=pickle.dumps(((), {}, None)),
        store_path=str(tmp_path / "store"),
        timeout_s=1.0,
        env={},
        log_path=str(tmp_path / "rank0.log"),
    )
    with pytest.raises(RendezvousError):
        _run(spec)
