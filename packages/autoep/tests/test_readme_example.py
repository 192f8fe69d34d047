"""The README's example runs as written in a fresh interpreter and prints what it says."""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).parents[1] / "README.md"


def test_the_readme_example_prints_its_routing_and_moe_output(tmp_path: Path) -> None:
    match = re.search(r"```python\n(.*?)```", README.read_text(), re.DOTALL)
    assert match, "the README has no python example"
    script = tmp_path / "example.py"
    script.write_text(match.group(1))
    done = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        check=False,
    )
    assert done.returncode == 0, done.stderr
    # Normalised softmax weights of logits 2 and 1: e^2 / (e^2 + e^1) = e / (e + 1).
    first = math.e / (math.e + 1)
    expected = f"[[0, 1]] [{round(first, 4)}, {round(1 - first, 4)}]"
    lines = done.stdout.splitlines()
    assert lines[0] == expected
    assert lines[1] == "(2, 8, 16) 32"  # 2 · 8 tokens, k = 2 routes each
