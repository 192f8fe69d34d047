"""Which SIMD path the CPU kernels run, and forcing one (for tests and benchmarks).

At load the extension picks the best path the CPU supports (avx512 > avx2 > scalar on x86,
sve > neon > scalar on aarch64), or the one named by ``DEEPSHARD_CPU_SIMD``. The choice is one
per process: `use_simd_path` changes it for every thread until the ``with`` block ends.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from deepshard.kernels import _extension

__all__ = ["REFERENCE", "active_simd_path", "available_simd_paths", "use_simd_path"]

REFERENCE = "reference"
"""What `active_simd_path` answers when the extension is unavailable (the pure-torch twins run)."""


def available_simd_paths() -> tuple[str, ...]:
    """The compiled paths this CPU can run, best last; empty without the extension."""
    extension = _extension.CPU_EXTENSION.get()
    return () if extension is None else tuple(extension.supported_paths())


def active_simd_path() -> str:
    """The path the next step runs on: ``"avx512"``, ``"avx2"``, ... or ``"reference"``."""
    extension = _extension.CPU_EXTENSION.get()
    return REFERENCE if extension is None else extension.active_path()


@contextmanager
def use_simd_path(name: str) -> Iterator[None]:
    """Runs the CPU kernels on path ``name`` inside the ``with`` block.

    Args:
        name: One of `available_simd_paths()`.

    Raises:
        ValueError: ``name`` is unknown, not compiled into this build, or not supported by this
            CPU.
        RuntimeError: The compiled extension is unavailable (only the reference runs).
    """
    extension = _extension.CPU_EXTENSION.get()
    if extension is None:
        raise RuntimeError(
            f"cannot select SIMD path {name!r}: the compiled CPU extension is unavailable "
            f"({_extension.CPU_EXTENSION.failure()}); only the pure-torch reference runs"
        )
    previous = extension.active_path()
    extension.set_path(name)
    try:
        yield
    finally:
        extension.set_path(previous)
