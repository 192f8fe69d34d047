"""Every profiler test runs in both counting modes: replayed after the step and eager."""

from __future__ import annotations

import pytest

from deepshard.profiler import CountMode


@pytest.fixture(params=["replay", "eager"])
def count_mode(request: pytest.FixtureRequest) -> CountMode:
    """How the profiler under test counts (the numbers must not depend on it)."""
    mode: CountMode = request.param
    return mode
