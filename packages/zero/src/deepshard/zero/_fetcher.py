"""When stage-3 units are gathered and released: the execution trace, prefetch, reuse, live window.

*Trace.* Each forward pass records the order in which units' forwards start (the root's forward
brackets the pass). The first pass's order becomes the trace; a later pass whose order differs
replaces it (it is re-recorded), and while the current pass still agrees with the trace so far,
the trace predicts what comes next.

*Fetching.* A unit needed now is gathered and waited for; then the units the trace says come
next are gathered asynchronously, in order, while their elements fit ``prefetch_bucket_size``
and the live window. In backward the same happens in reverse forward order.

*Releasing.* After a unit's forward it is released unless it is *resident* (the root, or at most
``param_persistence_threshold`` elements, while together within ``model_persistence_threshold``:
those stay gathered until the next optimizer step),
still in use (a unit nested in itself, or used again inside its own forward), or the trace says
it is used again — in this forward, or in the backward that follows when grad is enabled —
within ``max_reuse_distance`` gathered elements. A unit gathered for backward is held until its
gradients are complete (or the pass ends).

*Waits.* The blocking wait for a needed unit's gather is timed into a `GatherWaits` (the
exposed gather time), which also counts the gathers prefetch started and how many of them a
hook found already under way.

*Generation.* Forwards inside `untraced` (a rollout generating from the training model, no
grad) leave the trace, the current pass and the re-trace count as they were, so the next
training step prefetches by the training order; ``max_live`` lowers the live window meanwhile,
and everything not resident is released when the block ends.

*Live window.* The gathered elements of non-resident units never exceed
``max_live_parameters`` through prefetching; a unit needed now is gathered anyway, after
releasing units kept only for reuse, because units in use can never be released.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections import Counter
from collections.abc import Iterator, Sequence

from deepshard.zero._gather_waits import GatherWaits
from deepshard.zero._policy import ZeroPolicy
from deepshard.zero._unit_state import UnitState

__all__ = ["Fetcher"]


class Fetcher:
    """Gathers and releases units as forward and backward reach them.

    Args:
        units: Every unit's state, by unit index (0 is the root).
        policy: The prefetch, reuse, persistence and live-window knobs.
        externals: Per unit, the units it gathers with itself (owners of parameters it uses).
        waits: Where the blocking waits for needed gathers are timed and counted.
    """

    def __init__(
        self,
        units: Sequence[UnitState],
        policy: ZeroPolicy,
        externals: Sequence[set[int]],
        waits: GatherWaits,
    ) -> None:
        self.units = list(units)
        self.waits = waits
        self.policy = policy
        self.externals = externals
        self.resident = set(policy.resident_units([u.plan.numel for u in self.units]))
        self.trace: tuple[int, ...] = ()
        """The recorded forward order of unit indices."""
        self.current: list[int] = []
        """This (or the last) forward pass's order so far."""
        self.retraces = 0
        """How many times the trace was re-recorded after the first."""
        self.in_use: Counter[int] = Counter()
        self.held: set[int] = set()
        self.peak_live = 0
        """Most live elements (gathered or in flight, non-resident) seen since the last reset."""

    # --- accounting -------------------------------------------------------------------

    def live_numel(self) -> int:
        """Elements of non-resident units that are gathered or being gathered."""
        return sum(
            u.numel
            for u in self.units
            if (u.gathered or u.in_flight) and u.plan.index not in self.resident
        )

    def _note_live(self) -> None:
        self.peak_live = max(self.peak_live, self.live_numel())

    def _group(self, index: int) -> list[int]:
        return [index, *sorted(self.externals[index] - {index})]

    # --- forward ----------------------------------------------------------------------

    def begin_forward(self) -> None:
        """The root's forward starts: a new pass order."""
        self.current = []

    def end_forward(self, *, grad_enabled: bool) -> None:
        """The root's forward ended: keep or replace the trace; without grad release all."""
        if tuple(self.current) != self.trace:
            self.retraces += bool(self.trace)
            self.trace = tuple(self.current)
        if not grad_enabled:
            self.release_idle()

    @contextlib.contextmanager
    def untraced(self, *, max_live: int | None = None) -> Iterator[None]:
        """Forwards inside do not touch the recorded trace; ``max_live`` (elements) lowers
        ``max_live_parameters`` meanwhile; non-resident units are released on exit."""
        saved = (self.trace, list(self.current), self.retraces, self.policy)
        if max_live is not None:
            limit = min(max_live, self.policy.max_live_parameters)
            self.policy = dataclasses.replace(self.policy, max_live_parameters=limit)
        try:
            yield
        finally:
            self.trace, self.current, self.retraces, self.policy = saved
            self.release_idle()

    def _trace_valid(self) -> bool:
        n = len(self.current)
        return self.trace[:n] == tuple(self.current)

    def acquire(self, index: int, *, record: bool = True) -> int:
        """Gather ``index`` (and its externals) for its forward; returns its trace position."""
        if record:
            self.current.append(index)
        position = len(self.current) - 1
        group = self._group(index)
        for u in group:
            self.in_use[u] += 1
        try:
            self._demand(group)
        except BaseException:  # e.g. partitions offloaded: the forward does not happen
            for u in group:
                self.in_use[u] -= 1
            raise
        if record and self._trace_valid():
            self._prefetch(list(self.trace[position + 1 :]))
        return position

    def after_forward(self, index: int, position: int, *, grad_enabled: bool) -> None:
        """``index``'s forward ended: release what is not needed soon."""
        for u in self._group(index):
            self.in_use[u] -= 1
            if self.in_use[u] <= 0 and not self._kept(u, position, grad_enabled):
                self.units[u].release()

    def _kept(self, index: int, position: int, grad_enabled: bool) -> bool:
        if index in self.resident or index in self.held:
            return True
        if not self._trace_valid():
            return False
        upcoming = list(self.trace[position + 1 :])
        if grad_enabled:
            upcoming += list(reversed(self.trace))
        distance = 0
        for u in upcoming:
            if u == index or index in self.externals[u]:
                return distance <= self.policy.max_reuse_distance and (
                    self.live_numel() <= self.policy.max_live_parameters
                )
            distance += self.units[u].numel
        return False

    # --- backward ---------------------------------------------------------------------

    def acquire_for_backward(self, index: int, position: int) -> None:
        """``index``'s output got its first gradient: gather it, prefetch the previous units."""
        group = [u for u in self._group(index) if u not in self.held]
        if not group:
            return
        self.held.update(group)
        self._demand(group)
        if position >= 0 and self.trace[: len(self.current)] == tuple(self.current):
            self._prefetch(list(reversed(self.current[:position])))

    def grads_complete(self, index: int) -> None:
        """Every trainable parameter of ``index`` got its gradient: release it."""
        self.held.discard(index)
        if self.in_use[index] <= 0 and index not in self.resident:
            self.units[index].release()

    def end_backward(self) -> None:
        """The backward pass ended: release everything not resident or in use."""
        self.held.clear()
        self.release_idle()

    # --- gathering --------------------------------------------------------------------

    def release_idle(self) -> None:
        """Release every non-resident unit that is not in use or held."""
        for u in self.units:
            i = u.plan.index
            if i not in self.resident and self.in_use[i] <= 0 and i not in self.held:
                u.release()

    def pin(self, indices: Sequence[int]) -> None:
        """Gather ``indices`` and count them in use until `unpin` (held by hand)."""
        for u in indices:
            self.in_use[u] += 1
        self._demand(list(indices))

    def unpin(self, indices: Sequence[int]) -> None:
        """End one `pin`: release each unit that is no longer in use or held (resident too)."""
        for u in indices:
            self.in_use[u] -= 1
        self.release_unused(indices)

    def release_unused(self, indices: Sequence[int]) -> None:
        """Release each of ``indices`` that is not in use or held (resident ones too)."""
        for u in indices:
            if self.in_use[u] <= 0 and u not in self.held:
                self.units[u].release()

    def release_all(self) -> None:
        """Release every unit (the partitions changed: what is gathered is stale)."""
        for u in self.units:
            u.release()

    def _demand(self, group: list[int]) -> None:
        needed = sum(
            self.units[u].numel
            for u in group
            if u not in self.resident and not (self.units[u].gathered or self.units[u].in_flight)
        )
        if self.live_numel() + needed > self.policy.max_live_parameters:
            self._evict()
        for u in group:
            self.units[u].start_gather()
        self._note_live()
        self._wait(group)

    def _wait(self, group: list[int]) -> None:
        """Wait for ``group``'s gathers, timing only the waits on gathers still in flight."""
        waits, states = self.waits, [self.units[u] for u in group]
        for state in states:
            waits.prefetch_hits += int(state.early)
            state.early = False
        pending = [state for state in states if state.in_flight]
        if not pending:
            return
        start = waits.clock()
        for state in pending:
            state.wait_gather()
        waits.exposed_s += waits.clock() - start
        waits.waits += len(pending)

    def _evict(self) -> None:
        """Release units kept only for reuse (gathered, idle, not held)."""
        for u in self.units:
            i = u.plan.index
            idle = self.in_use[i] <= 0 and i not in self.held and not u.in_flight
            if u.gathered and idle and i not in self.resident:
                u.release()

    def _prefetch(self, upcoming: list[int]) -> None:
        budget = self.policy.prefetch_bucket_size
        for index in upcoming:
            for u in self._group(index):
                state = self.units[u]
                if state.gathered or state.in_flight:
                    continue
                if state.numel > budget:
                    return
                resident = u in self.resident
                limit = self.policy.max_live_parameters
                if not resident and self.live_numel() + state.numel > limit:
                    return
                state.start_gather(early=True)
                self.waits.prefetched += 1
                budget -= state.numel
                self._note_live()
