"""The README's example runs as written in a fresh interpreter and prints the numbers it says."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).parents[1] / "README.md"


def test_the_readme_example_prints_its_numbers(tmp_path: Path) -> None:
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
    forward = 2 * 32 * 64 * 192 + 2 * 2 * 4 * 16 * 16 * (16 + 16)
    # Backward: the projection's weight gradient (its input needs none) and SDPA's five products.
    backward = 2 * 32 * 64 * 192 + 2 * 2 * 4 * 16 * 16 * (3 * 16 + 2 * 16)
    assert done.stdout.splitlines()[0] == f"{forward} {backward}"
    assert "DeepShard FLOPs profiler" in done.stdout
