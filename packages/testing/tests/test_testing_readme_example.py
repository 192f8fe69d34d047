"""The README's example runs as written, as a script (its rank function must be importable)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_example_runs(tmp_path: Path) -> None:
    match = re.search(r"```python\n(.*?)```", README.read_text(), re.DOTALL)
    assert match is not None, "the README has no python example"
    script = tmp_path / "readme_example.py"
    script.write_text(match.group(1))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=240
    )
    assert done.returncode == 0, done.stderr
