"""The README's example runs as written."""

from __future__ import annotations

from pathlib import Path

from deepshard.testing import run_readme_example

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_first_python_block_runs() -> None:
    run_readme_example(README, in_process=True)
