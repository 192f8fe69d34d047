"""`tools/bench/autotp.py --quick` runs end to end: every row, its ratios and their verdicts.

One smoke run (the issue's tiny Llama, one round of 1 warm-up + 2 timed steps) of every row on
2 gloo ranks (the unsharded reference on 1). Every row's figures must be finite and positive,
every row must train the same model (the same first loss), DeepShard's parameter bytes per
rank must be about half the unsharded model's, and each ratio line must follow from the
table's printed figures: the ratio must lie within what the printed rounding of the two
figures allows, and its verdict must match its target. DeepSpeed's row is in the bench group:
without it the run must say ``skipped: deepspeed (...)``.
"""

from __future__ import annotations

import importlib.util
import math
import re
import subprocess
import sys
from decimal import Decimal
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
BENCH = REPO / "tools" / "bench" / "autotp.py"
ROW = re.compile(
    r"^\| (?P<name>[a-z0-9-]+) \| (?P<ranks>\d) \| (?P<best>[\d.]+) \| (?P<median>[\d.]+) "
    r"\| (?P<param>[\d.]+) \| (?P<rss>[\d.]+) \| (?P<loss>[\d.]+) \|$"
)
RATIO = re.compile(
    r"^deepshard-tp2 / (?P<theirs>\S+): (?P<what>(median )?step time|parameter bytes"
    r"|peak RSS growth) ratio (?P<ratio>[\d.]+) (\(target <= (?P<target>[\d.]+)\): "
    r"(?P<verdict>MET|MISSED by [\d.]+)|\(no target\))$"
)
COLUMNS = {
    "step time": "best",
    "median step time": "median",
    "parameter bytes": "param",
    "peak RSS growth": "rss",
}
HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None


@pytest.fixture(scope="module")
def output() -> str:
    done = subprocess.run(
        [sys.executable, str(BENCH), "--quick"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        cwd=BENCH.parent,
    )
    assert done.returncode == 0, f"exit {done.returncode}:\n{done.stdout}\n{done.stderr}"
    return done.stdout


def _rows(output: str) -> dict[str, re.Match[str]]:
    return {m["name"]: m for m in map(ROW.match, output.splitlines()) if m}


def _bounds(printed: str) -> tuple[float, float]:
    """The interval a figure printed as ``printed`` was rounded from."""
    half = Decimal(1).scaleb(Decimal(printed).as_tuple().exponent) / 2  # type: ignore[arg-type]
    return float(Decimal(printed) - half), float(Decimal(printed) + half)


def test_every_row_is_measured_and_trains_the_same_model(output: str) -> None:
    rows = _rows(output)
    want = ["deepshard-tp2", "dtensor-tp2", "unsharded"]
    if HAS_DEEPSPEED:
        want.append("deepspeed-tp2")
    else:
        assert "skipped: deepspeed (" in output, output
    assert sorted(rows) == sorted(want), output
    for row in rows.values():
        numbers = [float(row[k]) for k in ("best", "median", "param", "rss", "loss")]
        assert all(math.isfinite(n) and n > 0 for n in numbers), row[0]
        assert int(row["ranks"]) == (1 if row["name"] == "unsharded" else 2), row[0]
    assert len({row["loss"] for row in rows.values()}) == 1, output
    assert "ERROR" not in output
    half = float(rows["deepshard-tp2"]["param"]) / float(rows["unsharded"]["param"])
    assert 0.5 <= half <= 0.55, output  # split weights, plus the replicated norms


def test_ratios_follow_from_the_rows_and_carry_a_verdict(output: str) -> None:
    rows = _rows(output)
    ratios = [m for m in map(RATIO.match, output.splitlines()) if m]
    targeted = {(m["theirs"], m["what"]): m["target"] for m in ratios if m["target"]}
    want = {("dtensor-tp2", "step time"): "1.0", ("unsharded", "parameter bytes"): "0.55"}
    if HAS_DEEPSPEED:
        want[("deepspeed-tp2", "step time")] = "1.0"
    assert targeted == want, output
    every = {(m["theirs"], m["what"]) for m in ratios}
    competitors = [n for n in rows if n.endswith("-tp2") and n != "deepshard-tp2"]
    assert every == {(n, what) for n in competitors for what in COLUMNS} | {
        ("unsharded", what) for what in ("step time", "parameter bytes", "peak RSS growth")
    }, output
    ours = rows["deepshard-tp2"]
    for match in ratios:
        column = COLUMNS[match["what"]]
        low_a, high_a = _bounds(ours[column])
        low_b, high_b = _bounds(rows[match["theirs"]][column])
        low, high = _bounds(match["ratio"])
        assert low_a / high_b <= high and high_a / low_b >= low, match[0]
        if match["target"] is not None:
            met = float(match["ratio"]) <= float(match["target"])
            assert (match["verdict"] == "MET") == met, match[0]
            if not met:
                missed = float(match["verdict"].split()[-1])
                assert missed == pytest.approx(
                    float(match["ratio"]) - float(match["target"]), abs=1.5e-3
                ), match[0]
