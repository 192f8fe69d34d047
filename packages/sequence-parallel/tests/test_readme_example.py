"""The README's example runs as written (2 gloo ranks) and matches one process."""

from __future__ import annotations

import re
from pathlib import Path

from deepshard.testing import run_readme_example

README = Path(__file__).parents[1] / "README.md"


def test_the_readme_example_matches_one_process() -> None:
    line = run_readme_example(README, timeout_s=180).strip().splitlines()[0]
    printed = re.fullmatch(r"output (\(.*\)) max error (\S+)", line)
    assert printed, line
    assert printed.group(1) == "(2, 4, 8, 16)"
    assert float(printed.group(2)) <= 1e-12
