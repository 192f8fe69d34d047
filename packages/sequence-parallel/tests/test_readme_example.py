"""The README's example runs as written (2 gloo ranks) and matches one process."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).parents[1] / "README.md"


def test_the_readme_example_matches_one_process(tmp_path: Path) -> None:
    match = re.search(r"```python\n(.*?)```", README.read_text(), re.DOTALL)
    assert match, "the README has no python example"
    script = tmp_path / "example.py"
    script.write_text(match.group(1))
    done = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=180,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        check=False,
    )
    assert done.returncode == 0, done.stderr
    line = done.stdout.strip().splitlines()[0]
    printed = re.fullmatch(r"output (\(.*\)) max error (\S+)", line)
    assert printed, line
    assert printed.group(1) == "(2, 4, 8, 16)"
    assert float(printed.group(2)) <= 1e-12
