"""The README's first python block runs as written, in a fresh interpreter."""

from __future__ import annotations

from pathlib import Path

from deepshard.testing import run_readme_example

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_first_python_block_runs() -> None:
    out = run_readme_example(README, timeout_s=120)
    assert "node 1 worker-1: ranks 2-3, slots 0,1" in out
