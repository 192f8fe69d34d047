"""The continuous-batching scheduler follows a trace worked out by hand.

K=2 slots, budget 3, requests a, b, c submitted in that order; a's first token is an EOS.
Each generation step gives every active request one token (an admitted one its first, from its
prefill), and each ``schedule`` call counts the step before it:

====  =====================  ======================  ======================  ===================
call  counted before it      retired                 admitted                active after
====  =====================  ======================  ======================  ===================
1     nothing (no step yet)  -                       a -> 0, b -> 1          a@0 b@1
2     a 1 (EOS), b 1         a (EOS) from 0          c -> 0                  c@0 b@1
3     b 2, c 1               -                       -                       c@0 b@1
4     b 3, c 2               b (budget) from 1       -                       c@0
5     c 3                    c (budget) from 0       -                       (done)
====  =====================  ======================  ======================  ===================
"""

from __future__ import annotations

import pytest

from deepshard.inference._scheduler import ContinuousBatchScheduler
from deepshard.interface.errors import ConfigError


def test_hand_computed_trace() -> None:
    scheduler = ContinuousBatchScheduler(max_batch_size=2, max_new_tokens=3)
    for rid in "abc":
        scheduler.submit(rid)
    trace = []
    for finished in [(), ("a",), (), (), ()]:
        step = scheduler.schedule(finished)
        trace.append((step.retired, step.admitted, step.active, step.pending, step.done))
    assert trace == [
        ((), (("a", 0), ("b", 1)), (("a", 0), ("b", 1)), 1, False),
        ((("a", 0),), (("c", 0),), (("c", 0), ("b", 1)), 0, False),
        ((), (), (("c", 0), ("b", 1)), 0, False),
        ((("b", 1),), (), (("c", 0),), 0, False),
        ((("c", 0),), (), (), 0, True),
    ]


def test_fifo_admission_and_per_request_budgets() -> None:
    scheduler = ContinuousBatchScheduler(max_batch_size=1, max_new_tokens=5)
    scheduler.submit("long")
    scheduler.submit("short", max_new_tokens=1)
    scheduler.submit("two", max_new_tokens=2)
    order, steps = [], 0
    step = scheduler.schedule()
    while not step.done:
        order += [rid for rid, _ in step.admitted]
        steps += 1
        step = scheduler.schedule()
    assert order == ["long", "short", "two"]
    assert steps == 5 + 1 + 2  # one step per token of each budget, one request at a time


def test_compact_renumbers_active_slots() -> None:
    scheduler = ContinuousBatchScheduler(max_batch_size=3, max_new_tokens=4)
    for rid, budget in [("x", 1), ("y", 4), ("z", 4)]:
        scheduler.submit(rid, budget)
    scheduler.schedule()
    step = scheduler.schedule()
    assert step.retired == (("x", 0),) and step.active == (("y", 1), ("z", 2))
    assert scheduler.compact() == [1, 2]
    assert scheduler.schedule().active == (("y", 0), ("z", 1))
    assert scheduler.generated("y") == 2


def test_refusals() -> None:
    scheduler = ContinuousBatchScheduler(max_batch_size=2, max_new_tokens=3)
    scheduler.submit("a")
    with pytest.raises(ConfigError, match="'a' was already submitted"):
        scheduler.submit("a")
    with pytest.raises(ConfigError, match=r"request 'b'.max_new_tokens must be an integer > 0"):
        scheduler.submit("b", max_new_tokens=0)
    scheduler.schedule()
    with pytest.raises(ValueError, match="not active"):
        scheduler.schedule(["nobody"])
    scheduler.schedule(["a"])
    with pytest.raises(ConfigError, match="'a' was already submitted"):
        scheduler.submit("a")  # a retired id stays taken
    for bad in [(0, 3), (2, -1)]:
        with pytest.raises(ConfigError, match="must be"):
            ContinuousBatchScheduler(*bad)
