"""Where a generation's time goes: prefill and decode forwards, scheduling, cache management.

`GenerationProfile` is handed to `generate_requests` (``enable_profiling=True`` in the engine).
Forward and cache phases on an accelerator are timed with its events (recorded around the work,
read once at `GenerationProfile.summary`, so timing adds no synchronisation to the loop); on the
CPU, and for the scheduler (host-only work), with a host timer. Profiling only observes: the loop
runs the same operations with it on or off, so outputs are identical.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Literal

import torch

__all__ = ["GenerationProfile", "Phase"]

Phase = Literal["prefill", "decode", "scheduler", "cache"]
_PHASES: tuple[Phase, ...] = ("prefill", "decode", "scheduler", "cache")


class GenerationProfile:
    """Accumulates timings and counts over one or more `generate_requests` calls.

    Summary keys: ``prefill_forwards``, ``decode_forwards``, ``generated_tokens``, ``requests``,
    ``prefill_s``, ``decode_s``, ``scheduler_s``, ``cache_s``, ``total_s``, ``tokens_per_s``
    (generated tokens over ``total_s``) and ``time_to_first_token_s`` (from the start of the
    first call to the first token it produced).
    """

    def __init__(self) -> None:
        self._host_s: dict[Phase, float] = dict.fromkeys(_PHASES, 0.0)
        self._events: dict[Phase, list[tuple[torch.cuda.Event, torch.cuda.Event]]] = {
            phase: [] for phase in _PHASES
        }
        self._counts = {"prefill_forwards": 0, "decode_forwards": 0, "generated_tokens": 0}
        self._counts["requests"] = 0
        self._total_s = 0.0
        self._started: float | None = None
        self._first_token_s: float | None = None

    @contextmanager
    def run(self, requests: int) -> Iterator[None]:
        """Brackets one `generate_requests` call (its wall time goes to ``total_s``)."""
        self._started = time.perf_counter()
        self._counts["requests"] += requests
        try:
            yield
        finally:
            self._total_s += time.perf_counter() - self._started
            self._started = None

    @contextmanager
    def phase(self, name: Phase, device: torch.device | None = None) -> Iterator[None]:
        """Times the work inside; accelerator events when ``device`` is a CUDA device."""
        if device is not None and device.type == "cuda" and name != "scheduler":
            start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            start.record()
            try:
                yield
            finally:
                end.record()
                self._events[name].append((start, end))
            return
        began = time.perf_counter()
        try:
            yield
        finally:
            self._host_s[name] += time.perf_counter() - began

    def forward(self, name: Literal["prefill", "decode"]) -> None:
        """Counts one prefill or decode forward."""
        self._counts[f"{name}_forwards"] += 1

    def tokens(self, count: int) -> None:
        """Counts generated tokens; the first ones of a call set the time to first token."""
        if count and self._first_token_s is None and self._started is not None:
            self._first_token_s = time.perf_counter() - self._started
        self._counts["generated_tokens"] += count

    def seconds(self, name: Phase) -> float:
        """Total seconds of a phase (synchronises once with the device if events were used)."""
        events = self._events[name]
        if events:
            torch.cuda.synchronize()
        device_ms = sum(float(start.elapsed_time(end)) for start, end in events)
        return self._host_s[name] + device_ms / 1e3

    def summary(self) -> dict[str, float | int]:
        """Counts and timings so far, as a flat dict (see the class docstring for the keys)."""
        out: dict[str, float | int] = dict(self._counts)
        for name in _PHASES:
            out[f"{name}_s"] = self.seconds(name)
        out["total_s"] = self._total_s
        tokens = self._counts["generated_tokens"]
        out["tokens_per_s"] = tokens / self._total_s if self._total_s > 0 else 0.0
        out["time_to_first_token_s"] = self._first_token_s or 0.0
        return out
