"""The README's python example runs and prints what its comments claim."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def _first_python_block() -> str:
    match = re.search(r"```python\n(.*?)```", README.read_text(), flags=re.DOTALL)
    assert match, "README.md has no ```python block"
    return match.group(1)


def test_readme_example_runs() -> None:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(_first_python_block(), str(README), "exec"), {"__name__": "__readme__"})
    lines = out.getvalue().splitlines()
    # 64 samples over dp=4 ranks with 4 accumulation steps: 64 / (4 * 4) per micro-batch.
    assert lines[0] == f"(1, 4, 1, 1, 2) {64 // (4 * 4)}"
    assert lines[1] == "50000000 True"
    assert lines[2].startswith("zero_optimization.reduce_bucket_sise: unknown key; did you mean")
