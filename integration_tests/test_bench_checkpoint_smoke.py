"""`tools/bench/checkpoint.py --quick` runs end to end: every competitor's row, ratios, verdicts.

The benchmark runs once, in a subprocess, at its smoke size (a tiny model, one round, 2 gloo
ranks). DeepSpeed is only in the optional `bench` dependency group, so its row is required only
where it is importable; otherwise the run must say ``skipped: deepspeed``. Every ratio line must
follow from the table's figures (recomputed here from the printed times and sizes), and its
verdict from its target; each competitor's load time must be the fastest of the timed loads
the ``load tries`` line lists for it (two per round).
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
BENCH = REPO / "tools" / "bench" / "checkpoint.py"
ROW = re.compile(
    r"^\| (?P<name>[a-z+]+) \| (?P<fsync>yes|no) \| (?P<save>[\d.]+) \| (?P<save_tp>[\d.]+) "
    r"\| (?P<load>[\d.]+) "
    r"\| (?P<load_tp>[\d.]+) \| (?P<mb>[\d.]+) \|$"
)
RATIO = re.compile(
    r"^deepshard / (?P<theirs>[a-z]+): (?P<what>save|load) (?P<kind>time|throughput) ratio "
    r"(?P<ratio>[\d.]+) \(target (?P<sign><=|>=) (?P<target>[\d.]+)\): (?P<verdict>MET|MISSED)$"
)
TRIES = re.compile(r"^load tries, s \(each after an eviction; the fastest counts\): (?P<cells>.+)$")
ASYNC = re.compile(
    r"^deepshard async / sync: save blocking ratio (?P<ratio>[\d.]+) \(target <= 0.1\): "
    r"(?P<verdict>MET|MISSED) \(blocked (?P<blocked>[\d.]+) s, finished in (?P<total>[\d.]+) s\)$"
)


@pytest.fixture(scope="module")
def output() -> str:
    command = [sys.executable, str(BENCH), "--quick"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, (
        f"checkpoint.py exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
    )
    return done.stdout


def _rows(text: str) -> dict[str, dict[str, tuple[float, float]]]:
    """Each row's printed figures as (low, high): the printed value plus or minus half a unit
    in its last printed digit, the range the unrounded figure lies in."""
    return {
        m["name"]: {k: _bounds(m[k]) for k in ("save", "load", "mb")}
        for m in map(ROW.match, text.splitlines())
        if m
    }


def _bounds(printed: str) -> tuple[float, float]:
    decimals = len(printed.partition(".")[2])
    half_unit = 0.5 * 10.0**-decimals
    return float(printed) - half_unit, float(printed) + half_unit


@pytest.mark.timeout(700)
def test_every_competitor_has_a_row_and_every_ratio_follows(output: str) -> None:
    rows = _rows(output)
    expected = {"raw", "deepshard", "dcp"}
    if importlib.util.find_spec("deepspeed") is not None:
        expected |= {"deepspeed", "deepspeed+fsync"}
    else:
        assert "skipped: deepspeed" in output
    assert set(rows) == expected, output
    assert all(r[k][1] > 0 for r in rows.values() for k in ("save", "load", "mb"))
    ratios = [m for m in map(RATIO.match, output.splitlines()) if m]
    pairs = {(m["theirs"], m["what"]) for m in ratios}
    # deepspeed+fsync has no target: only a "both durable" line, which RATIO does not match.
    needed = {(t, w) for t in expected - {"deepshard", "deepspeed+fsync"} for w in ("save", "load")}
    assert pairs == needed, output
    for match in ratios:
        ours, theirs = rows["deepshard"], rows[match["theirs"]]
        what = match["what"]
        # The ratio is computed before the table rounds its figures, so it must lie in the
        # range the rounded figures allow (widened by the ratio's own rounding).
        if match["kind"] == "time":
            low = ours[what][0] / theirs[what][1]
            high = ours[what][1] / theirs[what][0]
        else:  # throughput: bytes over time
            low = (ours["mb"][0] / ours[what][1]) / (theirs["mb"][1] / theirs[what][0])
            high = (ours["mb"][1] / ours[what][0]) / (theirs["mb"][0] / theirs[what][1])
        ratio_low, ratio_high = _bounds(match["ratio"])
        assert ratio_high >= low and ratio_low <= high, (match[0], low, high)
        met = (
            float(match["ratio"]) <= float(match["target"])
            if match["sign"] == "<="
            else float(match["ratio"]) >= float(match["target"])
        )
        assert (match["verdict"] == "MET") == met, match[0]
    (tries_line,) = [m for m in map(TRIES.match, output.splitlines()) if m]
    tries = {
        name: [float(t) for t in times.split(" / ")]
        for name, _, times in (cell.partition(" ") for cell in tries_line["cells"].split("; "))
    }
    assert set(tries) == expected - {"deepspeed+fsync"}, tries_line[0]
    for name, times in tries.items():
        assert len(times) == 2, (name, times)  # --quick: one round, two timed loads
        low, high = rows[name]["load"]
        assert low - 5e-4 <= min(times) <= high + 5e-4, (name, times, rows[name]["load"])
    (async_line,) = [m for m in map(ASYNC.match, output.splitlines()) if m]
    assert float(async_line["blocked"]) <= float(async_line["total"])
    assert (async_line["verdict"] == "MET") == (float(async_line["ratio"]) <= 0.1)
    assert "ERROR" not in output
