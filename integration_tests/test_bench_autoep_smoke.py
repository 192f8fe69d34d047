"""`tools/bench/autoep.py --quick` runs end to end: the three rows (``hf-ddp``, ``hf-ddp-loop``,
``deepshard-ep2``) and the ``hf-alone`` reference, and ratios that follow from them;
DeepSpeed's AutoEP row (left out here with --no-deepspeed) ran or printed why it was skipped;
the ``--json`` report `run.py` collects holds the same step times and the paired ratios.

One smoke run (hidden 64, 8 experts, 1 warm-up + 4 timed steps per row on 2 gloo ranks). Every
row must report a positive step time and a tokens/s equal to tokens per step over it (to the
printed rounding); the target line must be ``deepshard-ep2`` over ``hf-ddp-loop`` (the experts
loop the target names) with the verdict its target says, the grouped line ``deepshard-ep2`` over
``hf-ddp`` with no verdict, and the ``hf-ddp / hf-alone`` line the quotient of those two rows.
The JSON's per-step times must give the printed medians, its step-time ratios must be the
step-by-step quotients of those times, and the DeepSpeed row must be listed as missing.
"""

from __future__ import annotations

import json
import re
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="transformers is in the dev group only")

REPO = Path(__file__).resolve().parent.parent
BENCH = REPO / "tools" / "bench" / "autoep.py"
ROW = re.compile(
    r"^(?P<name>hf-ddp|hf-ddp-loop|deepshard-ep2|hf-alone)\s+(?P<ms>[\d.]+)\s+(?P<rate>\d+)$"
)
TOKENS = re.compile(r"(?P<tokens>\d+) tokens/step")
RATIO = re.compile(
    r"^deepshard-ep2 / hf-ddp-loop tokens/s: (?P<ratio>[\d.]+)x \(target >= (?P<target>[\d.]+)x\): "
    r"(?P<verdict>MET|MISSED)$"
)
GROUPED = re.compile(
    r"^deepshard-ep2 / hf-ddp tokens/s: (?P<ratio>[\d.]+)x \(transformers' grouped experts; "
    r"no target\)$"
)
REFERENCE = re.compile(r"^hf-ddp / hf-alone step time: (?P<ratio>[\d.]+)x ")


@pytest.mark.timeout(600)
def test_both_rows_run_and_the_ratio_follows(tmp_path: Path) -> None:
    report_path = tmp_path / "autoep.json"
    done = subprocess.run(
        [sys.executable, str(BENCH), "--quick", "--no-deepspeed", "--json", str(report_path)],
        capture_output=True,
        text=True,
        timeout=560,
        check=False,
        cwd=BENCH.parent,
    )
    assert done.returncode == 0, f"exit {done.returncode}:\n{done.stdout}\n{done.stderr}"
    lines = done.stdout.splitlines()
    tokens_match = TOKENS.search(done.stdout)
    assert tokens_match is not None, done.stdout
    tokens = int(tokens_match["tokens"])
    rows = {m["name"]: m for m in map(ROW.match, lines) if m}
    assert sorted(rows) == ["deepshard-ep2", "hf-alone", "hf-ddp", "hf-ddp-loop"], done.stdout
    for row in rows.values():
        ms = float(row["ms"])
        assert ms > 0
        assert abs(int(row["rate"]) - tokens / (ms / 1e3)) <= 0.01 * int(row["rate"]) + 1
    ratio = next(m for m in map(RATIO.match, lines) if m)
    expected = int(rows["deepshard-ep2"]["rate"]) / int(rows["hf-ddp-loop"]["rate"])
    assert abs(float(ratio["ratio"]) - expected) <= 0.01 + 0.01 * expected
    met = float(ratio["ratio"]) >= float(ratio["target"])
    assert (ratio["verdict"] == "MET") == met
    grouped = next(m for m in map(GROUPED.match, lines) if m)
    expected_grouped = int(rows["deepshard-ep2"]["rate"]) / int(rows["hf-ddp"]["rate"])
    assert abs(float(grouped["ratio"]) - expected_grouped) <= 0.01 + 0.01 * expected_grouped
    # The reference line: hf-ddp's step time over hf-alone's (no gradient exchange).
    reference = next(m for m in map(REFERENCE.match, lines) if m)
    expected_ref = int(rows["hf-alone"]["rate"]) / int(rows["hf-ddp"]["rate"])
    assert abs(float(reference["ratio"]) - expected_ref) <= 0.01 + 0.01 * expected_ref
    # DeepSpeed's AutoEP row either ran (a ratio line) or says why not, with its error.
    ds_ran = any(line.startswith("deepshard-ep2 / deepspeed-autoep tokens/s: ") for line in lines)
    ds_skipped = re.search(r"^skipped: deepspeed autoep \(.+\)$", done.stdout, re.M)
    assert ds_ran or ds_skipped is not None, done.stdout

    # The JSON report: the same steps, the ratios paired step by step, DeepSpeed missing.
    report = json.loads(report_path.read_text())
    assert report["suite"] == "autoep"
    times = {name: figure["time_s"] for name, figure in report["figures"].items()}
    assert sorted(times) == ["deepshard-ep2", "hf-alone", "hf-ddp", "hf-ddp-loop"]
    for name, series in times.items():
        assert len(series) == 4  # --quick: 4 timed steps
        median_ms = statistics.median(series) * 1e3
        assert abs(median_ms - float(rows[name]["ms"])) <= 0.006, (name, median_ms)
    # hf-alone is a reference, not a competitor: no ratio row for it.
    by_theirs = {row["theirs"]: row for row in report["rows"]}
    assert sorted(by_theirs) == ["hf-ddp", "hf-ddp-loop"]
    for theirs, row in by_theirs.items():
        assert (row["ours"], row["measure"]) == ("deepshard-ep2", "step time")
        paired = [a / b for a, b in zip(times["deepshard-ep2"], times[theirs], strict=True)]
        assert row["ratios"] == pytest.approx(paired, rel=1e-12)
    assert report["missing"] == {"deepspeed-autoep": "left out (--no-deepspeed)"}
