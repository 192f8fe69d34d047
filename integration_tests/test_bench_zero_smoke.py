"""`tools/bench/zero.py --quick` runs end to end: a row per competitor, ratios and verdicts.

The benchmark runs once, in a subprocess, at its smoke size (a tiny model, 1 warm-up and 2
timed steps on 2 gloo ranks). DeepSpeed is only in the optional `bench` dependency group, so its
rows are required only where it is importable; otherwise each must be named on a ``skipped:``
line. The ratio lines must follow from the table's fastest steps.
"""

from __future__ import annotations

import importlib.util
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
BENCH = REPO / "tools" / "bench" / "zero.py"
ROW = re.compile(
    r"^\| (?P<name>[a-z]+(-\d)?) \| (?P<best>\S+) \| (?P<median>\S+) \| (?P<rss>\S+) "
    r"\| (?P<first>\S+) \| (?P<last>\S+) \|$"
)
RATIO = re.compile(
    r"^(?P<ours>deepshard-\d) / (?P<theirs>\S+): step time ratio (?P<ratio>[\d.]+) "
    r"\(target <= (?P<target>[\d.]+)\): (?P<verdict>MET|MISSED by [\d.]+)"
)


@pytest.fixture(scope="module")
def output() -> str:
    """The benchmark's stdout, from one run shared by this module's tests."""
    command = [sys.executable, str(BENCH), "--quick"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, f"zero.py exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
    return done.stdout


def _rows(output: str) -> dict[str, dict[str, float]]:
    rows = {}
    for line in output.splitlines():
        match = ROW.match(line)
        if match and match["best"] != "best":
            rows[match["name"]] = {
                key: float(match[key]) for key in ("best", "median", "rss", "first", "last")
            }
    return rows


def _expected() -> list[str]:
    names = ["ddp", "deepshard-0", "deepshard-1", "deepshard-2"]
    if importlib.util.find_spec("deepspeed") is not None:
        names += ["deepspeed-0", "deepspeed-1", "deepspeed-2"]
    return sorted(names)


def test_every_competitor_has_a_finite_row(output: str) -> None:
    rows = _rows(output)
    assert sorted(rows) == _expected(), output
    for name, row in rows.items():
        assert all(math.isfinite(value) for value in row.values()), name
        assert 0 < row["best"] <= row["median"] and row["rss"] >= 0, name
    if "deepspeed-0" not in rows:
        assert output.count("skipped: deepspeed-") == 3


def test_ratios_follow_from_the_fastest_steps_and_carry_a_verdict(output: str) -> None:
    rows = _rows(output)
    ratios = [m for m in map(RATIO.match, output.splitlines()) if m]
    pairs = {(m["ours"], m["theirs"]) for m in ratios}
    assert ("deepshard-0", "ddp") in pairs
    if "deepspeed-0" in rows:
        assert {(f"deepshard-{s}", f"deepspeed-{s}") for s in range(3)} <= pairs
    for match in ratios:
        ratio = rows[match["ours"]]["best"] / rows[match["theirs"]]["best"]
        # The table rounds the times to 4 decimals; the ratio is computed before rounding.
        assert float(match["ratio"]) == pytest.approx(ratio, rel=0.05, abs=2e-3)
        met = float(match["ratio"]) <= float(match["target"])
        assert (match["verdict"] == "MET") == met


def test_the_competitors_trained_the_same_model(output: str) -> None:
    rows = _rows(output)
    first = {row["first"] for row in rows.values()}
    assert len(first) == 1, rows  # same initial weights and data everywhere
    assert "ERROR" not in output
