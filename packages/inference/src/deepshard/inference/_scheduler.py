"""Which requests occupy the batch's rows, step by step (continuous batching).

The batch has ``max_batch_size`` rows (slots). Requests wait in a FIFO queue. One call to
`ContinuousBatchScheduler.schedule` sits between two generation steps, and a step produces one
token for every active request (the prefill of a newly admitted request produces its first
token, a decode step one more for each of the others). So each call first counts the step that
just ran — one more token for every request that was active — then retires the requests that
reported an EOS (``finished_ids``) or spent their token budget, freeing their slots, and admits
waiting requests, oldest first, into the free slots, lowest slot first. The first call admits
without counting (no step has run yet).

The scheduler holds ids and counts only; the generation loop owns the tokens and the cache, and
calls `ContinuousBatchScheduler.compact` when it compacts the cache, so both keep the same
request-to-row map.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Iterable
from dataclasses import dataclass

from deepshard.interface.errors import ConfigError

__all__ = ["ContinuousBatchScheduler", "ScheduleStep"]


@dataclass(frozen=True)
class ScheduleStep:
    """The outcome of one `ContinuousBatchScheduler.schedule` call.

    Attributes:
        retired: ``(request_id, slot)`` of the requests retired by this call.
        admitted: ``(request_id, slot)`` of the requests admitted by this call (their prefill
            runs next).
        active: ``(request_id, slot)`` of every request in the batch after this call, by slot
            (the admitted ones included).
        pending: How many requests still wait.
    """

    retired: tuple[tuple[Hashable, int], ...]
    admitted: tuple[tuple[Hashable, int], ...]
    active: tuple[tuple[Hashable, int], ...]
    pending: int

    @property
    def done(self) -> bool:
        """True when nothing is active and nothing waits."""
        return not self.active and self.pending == 0


class ContinuousBatchScheduler:
    """FIFO admission of requests into a fixed number of slots, with per-request token budgets.

    Args:
        max_batch_size: Number of slots (> 0).
        max_new_tokens: Default token budget of a request (> 0).
    """

    def __init__(self, max_batch_size: int, max_new_tokens: int) -> None:
        if max_batch_size <= 0:
            raise ConfigError(f"max_batch_size must be > 0, got {max_batch_size}")
        _check_budget(max_new_tokens, "max_new_tokens")
        self.max_batch_size = max_batch_size
        self.max_new_tokens = max_new_tokens
        self._queue: deque[Hashable] = deque()
        self._budget: dict[Hashable, int] = {}
        self._generated: dict[Hashable, int] = {}
        self._slot_of: dict[Hashable, int] = {}
        self._seen: set[Hashable] = set()
        self._started = False

    def submit(self, request_id: Hashable, max_new_tokens: int | None = None) -> None:
        """Queues a request.

        Args:
            request_id: Unique among every request this scheduler has seen.
            max_new_tokens: Its token budget (default: the scheduler's).

        Raises:
            ConfigError: The id was already submitted, or the budget is not > 0.
        """
        if request_id in self._seen:
            raise ConfigError(
                f"request id {request_id!r} was already submitted; give every request its own id"
            )
        budget = self.max_new_tokens if max_new_tokens is None else max_new_tokens
        _check_budget(budget, f"request {request_id!r}.max_new_tokens")
        self._seen.add(request_id)
        self._budget[request_id] = budget
        self._queue.append(request_id)

    def generated(self, request_id: Hashable) -> int:
        """Tokens counted so far for an active request."""
        return self._generated[request_id]

    def schedule(self, finished_ids: Iterable[Hashable] = ()) -> ScheduleStep:
        """Counts the step just run, retires finished requests, admits waiting ones.

        Args:
            finished_ids: Active requests that produced an EOS token in the step just run.

        Returns:
            What changed and what the batch holds now.

        Raises:
            ValueError: An id in ``finished_ids`` is not active.
        """
        finished = set(finished_ids)
        unknown = finished - set(self._slot_of)
        if unknown:
            raise ValueError(f"finished ids {sorted(map(repr, unknown))} are not active requests")
        if self._started:
            for request_id in self._slot_of:
                self._generated[request_id] += 1
        self._started = True
        retired = [
            (rid, slot)
            for rid, slot in sorted(self._slot_of.items(), key=lambda item: item[1])
            if rid in finished or self._generated[rid] >= self._budget[rid]
        ]
        for rid, _ in retired:
            del self._slot_of[rid], self._generated[rid], self._budget[rid]
        admitted = []
        free = sorted(set(range(self.max_batch_size)) - set(self._slot_of.values()))
        for slot in free:
            if not self._queue:
                break
            rid = self._queue.popleft()
            self._slot_of[rid], self._generated[rid] = slot, 0
            admitted.append((rid, slot))
        active = tuple(sorted(self._slot_of.items(), key=lambda item: item[1]))
        return ScheduleStep(tuple(retired), tuple(admitted), active, len(self._queue))

    def compact(self) -> list[int]:
        """Renumbers the active requests' slots to ``0..n-1``, keeping their order.

        Returns:
            The old slots in their new order (what `StaticKVCache.compact` takes).
        """
        order = sorted(self._slot_of.items(), key=lambda item: item[1])
        self._slot_of = {rid: new for new, (rid, _) in enumerate(order)}
        return [slot for _, slot in order]


def _check_budget(value: int, name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{name} must be an integer > 0, got {value!r}")
