"""The README's example runs as written, as a script (its rank function must be importable)."""

from __future__ import annotations

from pathlib import Path

from deepshard.testing import run_readme_example

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_example_runs() -> None:
    run_readme_example(README, timeout_s=240)
