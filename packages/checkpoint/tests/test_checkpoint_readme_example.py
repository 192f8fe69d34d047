"""The README's first python block runs as written, in a fresh process."""

from __future__ import annotations

from pathlib import Path

from deepshard.testing import run_readme_example

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_first_python_block_runs() -> None:
    out = run_readme_example(README, timeout_s=240)
    assert "loaded global_step7 {'lr': 0.1} columns 0-1 of (6, 4)" in out
