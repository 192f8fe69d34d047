"""The README's example runs as written in a fresh interpreter and prints the numbers it says."""

from __future__ import annotations

from pathlib import Path

from deepshard.testing import run_readme_example

README = Path(__file__).parents[1] / "README.md"


def test_the_readme_example_prints_its_numbers() -> None:
    out = run_readme_example(README, timeout_s=120)
    forward = 2 * 32 * 64 * 192 + 2 * 2 * 4 * 16 * 16 * (16 + 16)
    # Backward: the projection's weight gradient (its input needs none) and SDPA's five products.
    backward = 2 * 32 * 64 * 192 + 2 * 2 * 4 * 16 * 16 * (3 * 16 + 2 * 16)
    assert out.splitlines()[0] == f"{forward} {backward}"
    assert "DeepShard FLOPs profiler" in out
