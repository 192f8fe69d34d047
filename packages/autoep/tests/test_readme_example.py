"""The README's example runs as written in a fresh interpreter and prints what it says."""

from __future__ import annotations

import math
from pathlib import Path

from deepshard.testing import run_readme_example

README = Path(__file__).parents[1] / "README.md"


def test_the_readme_example_prints_its_routing_and_moe_output() -> None:
    lines = run_readme_example(README, timeout_s=120).splitlines()
    # Normalised softmax weights of logits 2 and 1: e^2 / (e^2 + e^1) = e / (e + 1).
    first = math.e / (math.e + 1)
    assert lines[0] == f"[[0, 1]] [{round(first, 4)}, {round(1 - first, 4)}]"
    assert lines[1] == "(2, 8, 16) 32"  # 2 · 8 tokens, k = 2 routes each
