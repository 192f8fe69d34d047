"""The first python block of the package README runs and prints what it says it prints."""

from __future__ import annotations

from pathlib import Path

from deepshard.testing import readme_example_code, run_readme_example

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_first_python_block_runs() -> None:
    assert "pip install deepshard-optimizers" in README.read_text(encoding="utf-8")
    code = readme_example_code(README)
    promised = [line.removeprefix("# ") for line in code.splitlines() if line.startswith("# {")]
    assert run_readme_example(README, in_process=True).strip().splitlines() == promised
