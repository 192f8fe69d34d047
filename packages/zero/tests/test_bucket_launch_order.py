"""Bucket reductions launch as soon as possible but always in the same order, whatever order
gradients arrive in; the end of a pass launches the rest; in-flight reductions are bounded."""

from __future__ import annotations

import pytest

from deepshard.interface.errors import CommError
from deepshard.zero import plan_flat_layout
from deepshard.zero._gradients import launch_order
from deepshard.zero._scheduler import BucketScheduler

ORDER = ["c", "b", "a", "empty"]
MEMBERS = {"a": 2, "b": 1, "c": 2, "empty": 0}


class Recorder:
    """Records launches and finishes of a scheduler's reductions."""

    def __init__(self) -> None:
        self.events: list[str] = []

    def launch(self, key: str) -> object:
        self.events.append(f"launch {key}")
        return lambda: self.events.append(f"finish {key}")


def _scheduler(max_inflight: int | None = None) -> tuple[BucketScheduler[str], Recorder]:
    rec = Recorder()
    return BucketScheduler(ORDER, MEMBERS, rec.launch, max_inflight), rec  # type: ignore[arg-type]


def test_full_buckets_wait_for_earlier_ones_in_the_order() -> None:
    sched, rec = _scheduler()
    sched.begin(reducing=True)
    sched.arrived("a", 0)
    sched.arrived("a", 1)  # "a" is full but "c" and "b" come first
    sched.arrived("b", 0)
    assert rec.events == []
    sched.arrived("c", 1)
    sched.arrived("c", 1)  # the same parameter twice before launch: still one member
    assert rec.events == []
    sched.arrived("c", 0)
    assert rec.events == ["launch c", "launch b", "launch a"]
    sched.flush()
    assert rec.events[3:] == ["finish c", "finish b", "finish a"]


def test_flush_launches_unfilled_buckets_and_skips_empty_ones() -> None:
    sched, rec = _scheduler()
    sched.begin(reducing=True)
    sched.arrived("b", 0)
    assert sorted(sched.missing()) == [("a", 2), ("c", 2)]
    sched.flush()
    launches = [e for e in rec.events if e.startswith("launch")]
    assert launches == ["launch c", "launch b", "launch a"]


def test_a_non_reducing_pass_launches_nothing() -> None:
    sched, rec = _scheduler()
    sched.begin(reducing=False)
    for key, count in MEMBERS.items():
        for member in range(count):
            sched.arrived(key, member)
    sched.flush()
    assert rec.events == [] and sched.missing() == []


def test_in_flight_reductions_are_bounded() -> None:
    sched, rec = _scheduler(max_inflight=1)
    sched.begin(reducing=True)
    for key in ("c", "b"):
        for member in range(MEMBERS[key]):
            sched.arrived(key, member)
    assert rec.events == ["launch c", "launch b", "finish c"]
    sync, rec0 = _scheduler(max_inflight=0)
    sync.begin(reducing=True)
    sync.arrived("b", 0)
    sync.flush()
    assert rec0.events == ["launch c", "finish c", "launch b", "finish b", "launch a", "finish a"]


def test_a_gradient_after_its_bucket_was_reduced_is_an_error() -> None:
    sched, _ = _scheduler()
    sched.begin(reducing=True)
    sched.arrived("c", 0)
    sched.arrived("c", 1)
    with pytest.raises(CommError, match="once per backward"):
        sched.arrived("c", 0)
    sched.begin(reducing=True)  # a new pass starts afresh
    sched.arrived("c", 0)


def test_launch_order_follows_registration_order_across_param_groups() -> None:
    # model order: w0 b0 w1 b1 w2 b2; group 0 holds the weights, group 1 the biases; one
    # parameter per bucket (bucket_numel=1)
    weights = plan_flat_layout(
        [(4, 3), (5, 4), (2, 5)], element_size=4, world_size=2, bucket_numel=1
    )
    biases = plan_flat_layout([(4,), (5,), (2,)], element_size=4, world_size=2, bucket_numel=1)
    positions = [(0, 2, 4), (1, 3, 5)]
    assert launch_order([weights, biases], positions) == [
        (1, 2),
        (0, 2),
        (1, 1),
        (0, 1),
        (1, 0),
        (0, 0),
    ]
    # without names: reverse buffer order, group by group
    assert launch_order([weights, biases]) == [(1, 2), (1, 1), (1, 0), (0, 2), (0, 1), (0, 0)]
    # a bucket of several parameters is complete when its earliest one is
    both = plan_flat_layout([(4, 3), (5, 4), (2, 5)], element_size=4, world_size=2, bucket_numel=40)
    assert [len(b.slots) for b in both.buckets] == [2, 1]
    assert launch_order([both], [(0, 2, 4)]) == [(0, 1), (0, 0)]
