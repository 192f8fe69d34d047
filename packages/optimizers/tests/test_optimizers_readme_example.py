"""The first python block of the package README runs and prints what it says it prints."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_first_python_block_runs() -> None:
    text = README.read_text(encoding="utf-8")
    assert "pip install deepshard-optimizers" in text
    match = re.search(r"```python\n(.*?)```", text, re.DOTALL)
    assert match is not None, "the README has no python example"
    code = match.group(1)
    output = io.StringIO()
    with contextlib.redirect_stdout(output):
        exec(compile(code, str(README), "exec"), {"__name__": "__readme__"})
    promised = [line.removeprefix("# ") for line in code.splitlines() if line.startswith("# {")]
    assert output.getvalue().strip().splitlines() == promised
