"""Shared fixtures of the kernels tests: one parametrization per compiled SIMD path."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

import deepshard.kernels as kernels
from deepshard.kernels import _extension


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    # Every test that takes `simd_path` runs once per path this build and CPU can run (scalar,
    # avx2, avx512 on this x86 machine; scalar, neon, sve on an SVE machine).
    if "simd_path" in metafunc.fixturenames:
        metafunc.parametrize("simd_path", kernels.available_simd_paths())


@pytest.fixture(autouse=True)
def _restore_active_path() -> Iterator[None]:
    # The active path is one per process; no test may leak its choice into the next one.
    extension = _extension.CPU_EXTENSION.get()
    before = None if extension is None else extension.active_path()
    yield
    if extension is not None and before is not None:
        extension.set_path(before)
