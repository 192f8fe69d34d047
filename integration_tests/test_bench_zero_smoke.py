"""`tools/bench/zero.py --quick` runs end to end, stages 0-2 and stage 3: rows, ratios, verdicts.

The benchmark runs once per stage set, in a subprocess, at its smoke size (a tiny model, 1
warm-up and 2 timed steps on 2 gloo ranks). DeepSpeed is only in the optional `bench`
dependency group, so its rows are required only where it is importable; otherwise each must be
named on a ``skipped:`` line. The ratio lines must follow from the table's fastest steps (or
peak RSS growth). A DeepShard row may be refused (stage 3 before it lands): then it must say
``REFUSED`` with DeepShard's reason, so must every ratio that needs it, and the run exits 2;
once the row is measured the same checks apply to it as to every other row.
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
    r"^\| (?P<name>[a-z0-9]+(-[a-z0-9]+)*) \| (?P<best>\S+) \| (?P<median>\S+) \| (?P<rss>\S+) "
    r"\| (?P<first>\S+) \| (?P<last>\S+) \|$"
)
RATIO = re.compile(
    r"^(?P<ours>deepshard-\S+) / (?P<theirs>\S+): (?P<measure>step time|peak RSS growth) ratio"
    r"(?P<rest>.*)$"
)
NUMBER = re.compile(
    r"^ (?P<ratio>[\d.]+) (\(target <= (?P<target>[\d.]+)\): (?P<verdict>MET|MISSED by [\d.]+)"
    r"|\(no target\))"
)
STAGE_SETS = {
    "0-2": ["ddp", *(f"{f}-{s}" for f in ("deepspeed", "deepshard") for s in range(3))],
    "3": [
        "fsdp2",
        "fsdp2-offload-all",
        *(
            f"{f}-3{o}"
            for f in ("deepspeed", "deepshard")
            for o in ("", "-offload-opt", "-offload-all")
        ),
    ],
}


@pytest.fixture(scope="module", params=sorted(STAGE_SETS))
def run(request: pytest.FixtureRequest) -> tuple[str, int, str]:
    """``(stage set, exit status, stdout)`` of one smoke run shared by this module's tests."""
    command = [sys.executable, str(BENCH), "--quick", "--stages", request.param]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode in (0, 2), (
        f"zero.py exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
    )
    return request.param, done.returncode, done.stdout


def _rows(output: str) -> dict[str, dict[str, float] | None]:
    """Measured rows as numbers; refused rows as ``None``."""
    rows: dict[str, dict[str, float] | None] = {}
    for line in output.splitlines():
        match = ROW.match(line)
        if not match or match["best"] == "best":
            continue
        if match["best"] == "REFUSED":
            rows[match["name"]] = None
            continue
        rows[match["name"]] = {
            key: float(match[key]) for key in ("best", "median", "rss", "first", "last")
        }
    return rows


def _expected(stage_set: str) -> list[str]:
    names = STAGE_SETS[stage_set]
    if importlib.util.find_spec("deepspeed") is None:
        names = [n for n in names if not n.startswith("deepspeed")]
    return sorted(names)


def test_every_competitor_has_a_finite_row_or_a_stated_refusal(run: tuple[str, int, str]) -> None:
    stage_set, status, output = run
    rows = _rows(output)
    assert sorted(rows) == _expected(stage_set), output
    refused = sorted(name for name, row in rows.items() if row is None)
    assert all(name.startswith("deepshard-") for name in refused), output
    assert status == (2 if refused else 0), output
    for name in refused:
        reason = re.search(rf"^{name} refused: (\S.*)$", output, re.MULTILINE)
        assert reason and "zero_optimization" in reason[1], output  # DeepShard's own words
    for name, row in rows.items():
        if row is not None:
            assert all(math.isfinite(value) for value in row.values()), name
            assert 0 < row["best"] <= row["median"] and row["rss"] >= 0, name
    if importlib.util.find_spec("deepspeed") is None:
        deepspeed = [n for n in STAGE_SETS[stage_set] if n.startswith("deepspeed-")]
        assert output.count("skipped: deepspeed-") == len(deepspeed)


def test_ratios_follow_from_the_rows_and_carry_a_verdict(run: tuple[str, int, str]) -> None:
    stage_set, _, output = run
    rows = _rows(output)
    ratios = [m for m in map(RATIO.match, output.splitlines()) if m]
    pairs = {(m["ours"], m["theirs"], m["measure"]) for m in ratios}
    required = {
        "0-2": [("deepshard-0", "ddp"), ("deepshard-1", "ddp"), ("deepshard-2", "ddp")],
        "3": [("deepshard-3", "fsdp2"), ("deepshard-3-offload-all", "fsdp2-offload-all")],
    }[stage_set]
    assert {(ours, theirs, "step time") for ours, theirs in required} <= pairs, output
    if stage_set == "3":
        assert ("deepshard-3", "fsdp2", "peak RSS growth") in pairs, output
    if "deepspeed-0" in rows:
        assert {(f"deepshard-{s}", f"deepspeed-{s}", "step time") for s in range(3)} <= pairs
    for match in ratios:
        ours, theirs = rows[match["ours"]], rows[match["theirs"]]
        assert theirs is not None, match[0]  # only DeepShard rows can be refused
        if ours is None:
            assert match["rest"].startswith(": REFUSED"), match[0]
            continue
        number = NUMBER.match(match["rest"])
        assert number, match[0]
        column = "best" if match["measure"] == "step time" else "rss"
        # The table rounds to 4 decimals (MiB to 1); the ratio is computed before rounding.
        expected = ours[column] / theirs[column]
        assert float(number["ratio"]) == pytest.approx(expected, rel=0.05, abs=2e-3), match[0]
        if number["target"] is not None:
            met = float(number["ratio"]) <= float(number["target"])
            assert (number["verdict"] == "MET") == met, match[0]


def test_the_competitors_trained_the_same_model(run: tuple[str, int, str]) -> None:
    _, _, output = run
    rows = [row for row in _rows(output).values() if row is not None]
    first = {row["first"] for row in rows}
    assert len(first) == 1, rows  # same initial weights and data everywhere
    assert "ERROR" not in output
