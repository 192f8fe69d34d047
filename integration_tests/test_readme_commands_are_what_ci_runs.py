"""The set-up commands README.md gives a user are exactly the ones CI runs.

The README's first screen promises that two commands work on a fresh machine with only Python and
uv: the 2-rank smoke run and the test suite. `.ci/run` runs both, so this test pins the README and
the CI script to the same text: neither can drift without the other.
"""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SMOKE = "uv run --all-packages torchrun --standalone --nproc_per_node=2 examples/comm_smoke.py"
TESTS = "uv run --all-packages pytest"


def _bash_blocks(markdown: str) -> list[str]:
    return [block.strip() for block in re.findall(r"```bash\n(.*?)```", markdown, flags=re.S)]


def _ci_commands() -> str:
    # Join continued lines, so a command split with a trailing backslash reads as one line.
    script = (REPO / ".ci" / "run").read_text()
    return re.sub(r"\\\n\s*", "", script)


def test_readme_opens_with_the_smoke_run_then_the_tests() -> None:
    blocks = _bash_blocks((REPO / "README.md").read_text())
    assert blocks[:2] == [SMOKE, TESTS]


def test_ci_runs_both_readme_commands() -> None:
    lines = [line.strip() for line in _ci_commands().splitlines()]
    assert any(line.endswith(SMOKE) for line in lines), f".ci/run does not run `{SMOKE}`"
    assert any(line.split(" || ")[0] == TESTS for line in lines), f".ci/run lacks `{TESTS}`"


def test_the_smoke_script_exists() -> None:
    assert (REPO / SMOKE.split()[-1]).is_file()


def test_ci_script_is_executable_and_strict() -> None:
    script = REPO / ".ci" / "run"
    assert script.stat().st_mode & 0o111, ".ci/run must be executable (chmod +x .ci/run)"
    assert "set -euo pipefail" in script.read_text()
