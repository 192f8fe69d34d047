"""``ds-checkpoint --help`` and argument errors answer without importing torch.

Each probe runs in a fresh interpreter (this test process has torch loaded already): it calls
the CLI's ``main`` and reports its exit status and whether ``torch`` got imported. A control
probe runs a command that does need torch, so the probe is shown to notice it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

_PROBE = """
import json, sys
from deepshard.checkpoint.cli import main
try:
    code = main(sys.argv[1:])
except SystemExit as exc:
    code = exc.code
print(json.dumps({"code": code, "torch": "torch" in sys.modules}))
"""


def _probe(*argv: str) -> tuple[dict[str, object], str]:
    done = subprocess.run(
        [sys.executable, "-c", _PROBE, *argv],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    report: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    return report, done.stdout + done.stderr


@pytest.mark.parametrize(
    ("argv", "code"),
    [
        (["--help"], 0),
        (["export", "--help"], 0),
        (["reshard", "a", "b", "--dp", "0"], 2),
        (["export", "a", "b", "--dtype", "fp8"], 2),
        (["frobnicate"], 2),
        ([], 2),
    ],
)
def test_help_and_argument_errors_import_no_torch(argv: list[str], code: int) -> None:
    report, output = _probe(*argv)
    assert report == {"code": code, "torch": False}, output


def test_argument_errors_name_the_flag() -> None:
    _, output = _probe("reshard", "a", "b", "--dp", "0")
    assert "--dp: 0 must be >= 1" in output
    _, output = _probe("export", "a", "b", "--dtype", "fp8")
    assert "--dtype" in output and "bf16" in output


def test_the_probe_sees_torch_when_a_command_needs_it(tmp_path: Path) -> None:
    report, output = _probe("verify", str(tmp_path / "missing"))
    assert report == {"code": 1, "torch": True}, output
    assert "ds-checkpoint: error:" in output or "FAILED" in output


def test_console_script_is_installed() -> None:
    script = Path(sys.executable).with_name("ds-checkpoint")
    done = subprocess.run([str(script), "--help"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "import-deepspeed" in done.stdout
