"""`tools/bench/sequence_parallel.py --quick` runs end to end: rows, ratios and their verdicts.

One smoke run (1,024 tokens, 1 warm-up + 1 timed step on 2 gloo ranks) of the rows the memory
targets need (DeepSpeed's row is left out: its first run JIT-builds an op for minutes). Every
row must be finite, every row's first loss must equal sp1's (the same weights and sequence),
and each ratio line must follow from the table.
"""

from __future__ import annotations

import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
BENCH = REPO / "tools" / "bench" / "sequence_parallel.py"
ROWS = ["sp1", "sp1-tiled", "sp2", "sp2-tiled"]
ROW = re.compile(
    r"^\| (?P<name>[a-z0-9-]+) \| (?P<best>[\d.]+) \| (?P<median>[\d.]+) \| (?P<peak>[\d.]+) "
    r"\| (?P<logits>[\d.]+) \| (?P<loss>[\d.]+) \|$"
)
RATIO = re.compile(
    r"^(?P<ours>\S+) / (?P<theirs>\S+): (?P<what>activation peak|logits peak|step time) ratio "
    r"(?P<ratio>[\d.]+) (\(target <= (?P<target>[\d.]+)\): (?P<verdict>MET|MISSED by [\d.]+)"
    r"|\(no target\))$"
)
COLUMNS = {"activation peak": "peak", "logits peak": "logits", "step time": "best"}


@pytest.fixture(scope="module")
def output() -> str:
    command = [sys.executable, str(BENCH), "--quick", "--rows", ",".join(ROWS)]
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=600, check=False, cwd=BENCH.parent
    )
    assert done.returncode == 0, f"exit {done.returncode}:\n{done.stdout}\n{done.stderr}"
    return done.stdout


def test_every_row_is_measured_and_trains_the_same_model(output: str) -> None:
    rows = {m["name"]: m for m in map(ROW.match, output.splitlines()) if m}
    assert sorted(rows) == sorted(ROWS), output
    for row in rows.values():
        numbers = [float(row[k]) for k in ("best", "median", "peak", "logits", "loss")]
        assert all(math.isfinite(n) and n > 0 for n in numbers), row[0]
    # One model, one batch: the first losses agree up to fp32 summation order (the tiled loss
    # sums its shards separately; ~1e-7 relative per add) and the 6 printed decimals (+-5e-7).
    losses = [float(row["loss"]) for row in rows.values()]
    assert max(losses) - min(losses) <= 1e-6 + 1e-6 * max(losses), output
    assert "ERROR" not in output


def test_ratios_follow_from_the_rows_and_carry_a_verdict(output: str) -> None:
    rows = {m["name"]: m for m in map(ROW.match, output.splitlines()) if m}
    ratios = [m for m in map(RATIO.match, output.splitlines()) if m]
    targeted = {(m["ours"], m["theirs"], m["what"]) for m in ratios if m["target"]}
    assert targeted == {
        ("sp2", "sp1", "activation peak"),
        ("sp1-tiled", "sp1", "logits peak"),
        ("sp2-tiled", "sp2", "logits peak"),
    }, output
    for match in ratios:
        column = COLUMNS[match["what"]]
        expected = float(rows[match["ours"]][column]) / float(rows[match["theirs"]][column])
        assert float(match["ratio"]) == pytest.approx(expected, rel=0.05, abs=2e-3), match[0]
        if match["target"] is not None:
            met = float(match["ratio"]) <= float(match["target"])
            assert (match["verdict"] == "MET") == met, match[0]
