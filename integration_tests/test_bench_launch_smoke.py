"""``tools/bench/launch.py`` runs end to end and prints its table, medians, ratio and verdict.

One launch per launcher (``--runs 1``) keeps it short; the numbers themselves are machine
dependent, so the test checks their consistency (the ratio is the quotient of the printed
medians, the verdict follows from the ratio), not their values.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
BENCH = REPO / "tools" / "bench" / "launch.py"
BIN = Path(sys.executable).parent
FLOAT = r"(\d+\.\d{3})"


def test_launch_bench_prints_runs_medians_ratio_and_verdict() -> None:
    for program in ("ds-launch", "torchrun"):
        if not (BIN / program).exists():
            pytest.skip(f"{program} is not installed beside {sys.executable}")
    done = subprocess.run(
        [sys.executable, str(BENCH), "--runs", "1"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    for launcher in ("ds-launch", "torchrun"):
        assert re.search(rf"^\s+1\s+{launcher}\s+{FLOAT}\s+{FLOAT}$", out, re.M), out
    medians = {
        launcher: float(match[1])
        for launcher, match in (
            (name, re.search(rf"^{name}\s+{FLOAT}\s+{FLOAT}$", out, re.M))
            for name in ("ds-launch", "torchrun")
        )
        if match is not None
    }
    assert set(medians) == {"ds-launch", "torchrun"}, out
    ratio_match = re.search(rf"^ratio ds-launch / torchrun \(median to init\): {FLOAT}$", out, re.M)
    assert ratio_match is not None, out
    ratio = float(ratio_match[1])
    assert ratio == pytest.approx(medians["ds-launch"] / medians["torchrun"], abs=2e-3)
    verdict = re.search(r"^target: ds-launch no slower than torchrun: (MET|MISSED)$", out, re.M)
    assert verdict is not None, out
    assert verdict[1] == ("MET" if ratio <= 1.0 else "MISSED")
