"""``tools/bench/run.py``'s table, page and ZeRO plot points on made-up suite reports.

Functions of plain data, so no suite runs: the ratios' min/median/max, a missing competitor
reported beside DeepShard's own figures, a failed suite, and the stage each ZeRO row plots at.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools" / "bench"))
import _bench_docs  # (the bench's modules import each other by bare name)
import _bench_json
import _zero_report
import run

ZERO = {
    "suite": "zero",
    "rows": [_bench_json.ratio_row("deepshard-1", "ddp", "step time", [0.9, 1.2, 0.6])],
    "figures": {
        "ddp": {"time_s": [0.5, 0.4], "peak_mib": 300.0, "stage": _zero_report._stage("ddp")},
        "deepshard-1": {"time_s": [0.3, 0.2, 0.25], "peak_mib": 280.0, "stage": "1"},
        "deepshard-3-offload-opt": {
            "time_s": [0.7],
            "peak_mib": None,
            "stage": _zero_report._stage("deepshard-3-offload-opt"),
        },
    },
    "missing": {"deepspeed-1": "deepspeed is not importable; install the bench group"},
    "exit": 0,
}
FAILED = {"suite": "launch", "failed": "exited 1 without writing its JSON", "output": ""}


def test_table_has_min_median_max_and_says_who_is_missing_or_failed() -> None:
    table = run.ratio_table([ZERO, FAILED])
    assert table == [
        {"suite": "zero", "ours": "deepshard-1", "theirs": "ddp", "measure": "step time",
         "min": 0.6, "median": 0.9, "max": 1.2, "n": 3},
    ]  # fmt: skip
    lines = run.table_lines(table, [ZERO, FAILED])
    assert lines[2] == "| zero | deepshard-1 | ddp | step time | 0.600 | 0.900 | 1.200 | 3 |"
    assert any("deepspeed-1 missing" in line and "DeepShard's own" in line for line in lines)
    assert "- launch: FAILED (exited 1 without writing its JSON)" in lines


def test_page_lists_each_suites_figures_and_the_machine() -> None:
    result = {"machine": {"cpu": "Test CPU", "cores": 2}, "quick": True, "note": "loaded box"}
    result |= {"table": run.ratio_table([ZERO]), "suites": [ZERO, FAILED]}
    page = "\n".join(_bench_docs.page_lines(result, ["TABLE"], plotted=False))
    assert "| cpu | Test CPU |" in page and "Note: loaded box" in page and "TABLE" in page
    assert "| deepshard-1 | 0.2 | 0.25 | 280.0 |" in page  # best, median, peak
    assert "| deepshard-3-offload-opt | 0.7 | 0.7 | - |" in page
    assert "Failed: exited 1 without writing its JSON." in page
    assert "matplotlib is not installed" in page


def test_zero_points_group_rows_by_engine_and_stage() -> None:
    points = _bench_docs.zero_points({"suites": [ZERO, FAILED]})
    assert points == {
        "ddp": {"0": (0.4, 300.0)},
        "deepshard": {"1": (0.2, 280.0), "3-offload-opt": (0.7, None)},
    }


def test_paired_ratios_refuse_unequal_rounds() -> None:
    assert _bench_json.paired_ratios([1.0, 3.0], [2.0, 2.0]) == [0.5, 1.5]
    with pytest.raises(ValueError, match="1 rounds against 2"):
        _bench_json.paired_ratios([1.0], [1.0, 2.0])


def test_zero_json_pairs_each_rounds_fastest_step_and_skips_refusals(tmp_path: Path) -> None:
    def rank(times: list[float], rss: int) -> dict[str, object]:
        return {
            "times": times,
            "rss_delta": rss,
            "losses": [2.0, 1.0],
            "params": 10,
            "tensor_bytes": None,
        }

    reports = {
        "ddp": [[rank([0.5, 0.4], 200 << 20), rank([0.6], 210 << 20)], [rank([0.8, 0.2], 0)] * 2],
        "deepshard-1": [[rank([0.3, 0.2], 100 << 20)] * 2, [rank([0.1, 0.3], 105 << 20)] * 2],
        "deepshard-2": [[{"refused": "stage 2 refused"}] * 2],
    }
    rows = {name: _zero_report.summarise(ranks) for name, ranks in reports.items()}
    path = tmp_path / "zero.json"
    _zero_report.write_json(path, reports, rows, {"deepspeed-1": "not importable"})
    report = json.loads(path.read_text())
    by_pair = {(r["ours"], r["theirs"], r["measure"]): r["ratios"] for r in report["rows"]}
    # Round 1: 0.2 / 0.4; round 2: 0.1 / 0.2. Memory: the larger rank's peak, 105 / 210 MiB.
    assert by_pair == {
        ("deepshard-1", "ddp", "step time"): [0.5, 0.5],
        ("deepshard-1", "ddp", "peak RSS growth"): [0.5],
    }
    assert report["figures"]["deepshard-1"] == {
        "time_s": [0.3, 0.2, 0.1, 0.3], "peak_mib": 105.0, "stage": "1",
    }  # fmt: skip
    assert report["missing"] == {
        "deepspeed-1": "not importable",
        "deepshard-2": "refused: stage 2 refused",
    }
