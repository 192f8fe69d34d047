"""The set-up commands README.md gives a user are exactly the ones CI runs.

The README's first screen promises that two commands work on a fresh machine with only Python and
uv: the main job (2-rank CPU pretraining) and the test suite. `.ci/run` runs both, so this test
pins the README and the CI script to the same text: neither can drift without the other.
"""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MAIN_JOB = "uv run --all-packages ds-launch --nproc_per_node 2 examples/pretrain/train.py"
TESTS = "uv run --all-packages pytest"


def _bash_blocks(markdown: str) -> list[str]:
    return [block.strip() for block in re.findall(r"```bash\n(.*?)```", markdown, flags=re.S)]


def _ci_commands() -> str:
    # Join continued lines, so a command split with a trailing backslash reads as one line.
    script = (REPO / ".ci" / "run").read_text()
    return re.sub(r"\\\n\s*", "", script)


def test_readme_opens_with_the_main_job_then_the_tests() -> None:
    blocks = _bash_blocks((REPO / "README.md").read_text())
    assert blocks[:2] == [MAIN_JOB, TESTS]


def test_ci_runs_both_readme_commands() -> None:
    lines = [line.strip() for line in _ci_commands().splitlines()]
    assert any(line.endswith(MAIN_JOB) for line in lines), f".ci/run does not run `{MAIN_JOB}`"
    assert any(line.split(" || ")[0] == TESTS for line in lines), f".ci/run lacks `{TESTS}`"


def test_the_main_job_script_and_its_config_exist() -> None:
    script = REPO / MAIN_JOB.split()[-1]
    assert script.is_file()
    assert (script.parent / "ds_config.json").is_file()


def test_ci_script_is_executable_and_strict() -> None:
    script = REPO / ".ci" / "run"
    assert script.stat().st_mode & 0o111, ".ci/run must be executable (chmod +x .ci/run)"
    assert "set -euo pipefail" in script.read_text()
