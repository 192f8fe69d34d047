"""When each bucket's reduction is launched: as soon as it is full, but in one fixed order.

During backward, gradients arrive in whatever order autograd produces them, which may differ
between ranks (or between steps). Collectives must be issued in the same order on every rank,
so buckets are launched in a fixed order (reverse buffer order, the usual order of backward):
a full bucket waits until every bucket before it in that order has been launched. Launched
reductions stay in flight, overlapping with the rest of backward, and are finished by `flush`
(or earlier, when more than ``max_inflight`` are pending, to bound the memory they hold).
At the end of a backward, `flush` also launches the buckets that never filled: parameters that
got no gradient count as zero gradients.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Hashable, Sequence
from typing import Generic, TypeVar

from deepshard.interface.errors import CommError

__all__ = ["BucketScheduler"]

K = TypeVar("K", bound=Hashable)

Finish = Callable[[], None]
"""Completes one launched reduction (waits on it and stores its result)."""


class BucketScheduler(Generic[K]):
    """Tracks which buckets are full and launches their reductions in a fixed order.

    Args:
        order: Every bucket key, in launch order.
        members: How many distinct parameters fill each bucket (buckets with none are never
            launched: they hold no data).
        launch: Starts the reduction of a bucket and returns what finishes it.
        max_inflight: Most launched reductions left pending before the oldest is finished;
            ``None`` for no limit.
    """

    def __init__(
        self,
        order: Sequence[K],
        members: dict[K, int],
        launch: Callable[[K], Finish],
        max_inflight: int | None = None,
    ) -> None:
        self._order = [key for key in order if members[key] > 0]
        self._position = {key: i for i, key in enumerate(self._order)}
        self._members = members
        self._launch = launch
        self._max_inflight = max_inflight
        self._arrived: dict[K, set[int]] = {key: set() for key in self._order}
        self._next = 0
        self._reducing = False
        self._inflight: deque[Finish] = deque()

    def begin(self, *, reducing: bool) -> None:
        """Start a backward pass; only a ``reducing`` one launches reductions."""
        for seen in self._arrived.values():
            seen.clear()
        self._next = 0
        self._reducing = reducing

    def arrived(self, key: K, member: int) -> None:
        """Record that parameter ``member`` of bucket ``key`` has its gradient for this pass.

        Raises:
            CommError: The bucket was already reduced in this pass (a gradient arrived twice,
                e.g. under reentrant activation checkpointing), so this one would be lost.
        """
        if self._reducing and self._launched(key):
            raise CommError(
                f"a gradient for parameter {member} arrived after its bucket was reduced in this "
                "backward pass; every parameter may receive its gradient once per backward "
                "(use non-reentrant activation checkpointing)"
            )
        self._arrived[key].add(member)
        if self._reducing:
            self._launch_ready()

    def has_arrived(self, key: K, member: int) -> bool:
        """Whether parameter ``member`` of bucket ``key`` already has a gradient in this pass."""
        return member in self._arrived[key]

    def absent(self, key: K, members: Sequence[int]) -> list[int]:
        """Those of ``members`` (bucket ``key``'s) with no gradient yet in this pass."""
        seen = self._arrived[key]
        return [m for m in members if m not in seen]

    def missing(self) -> list[tuple[K, int]]:
        """Buckets and how many of their parameters got no gradient in this pass."""
        return [
            (key, self._members[key] - len(seen))
            for key, seen in self._arrived.items()
            if len(seen) < self._members[key]
        ]

    def flush(self) -> None:
        """Launch every bucket not yet launched (in order) and finish all reductions."""
        if self._reducing:
            while self._next < len(self._order):
                self._start(self._order[self._next])
        while self._inflight:
            self._inflight.popleft()()

    def _launched(self, key: K) -> bool:
        return self._position[key] < self._next

    def _launch_ready(self) -> None:
        while self._next < len(self._order):
            key = self._order[self._next]
            if len(self._arrived[key]) < self._members[key]:
                return
            self._start(key)

    def _start(self, key: K) -> None:
        self._next += 1
        self._inflight.append(self._launch(key))
        limit = self._max_inflight
        while limit is not None and len(self._inflight) > limit:
            self._inflight.popleft()()
