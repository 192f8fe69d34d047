"""The README's example runs as written, in a fresh single-process interpreter."""

from __future__ import annotations

from pathlib import Path

from deepshard.testing import run_readme_example

README = Path(__file__).parents[1] / "README.md"


def test_the_readme_example_trains_on_one_cpu_rank() -> None:
    out = run_readme_example(README, timeout_s=180, env={"DEEPSHARD_ACCELERATOR": "cpu"})
    # 64 samples in micro-batches of 4, 2 per step: 8 optimizer steps.
    assert out.startswith("8 steps, lr 1.00e-03, loss ")
