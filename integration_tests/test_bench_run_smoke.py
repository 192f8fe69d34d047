"""``tools/bench/run.py --quick`` on the two cheapest suites: table, JSON, page and plot agree.

The figures are machine dependent, so the test checks consistency, not values: every ratio the
table prints is recomputed from the numbers the suite itself printed on stdout (the watchdog's
median microseconds per call, the profiler's median step milliseconds), and the JSON, the
rendered ``benchmarks.md`` and the plot hold the same rows.
"""

from __future__ import annotations

import json
import re
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
RUN = REPO / "tools" / "bench" / "run.py"
ROW = re.compile(
    r"^\| (\w+) \| (.+?) \| (.+?) \| (.+?) \| (\S+) \| (\S+) \| (\S+) \| (\d+) \|$", re.M
)


def _watchdog_medians(out: str) -> dict[str, list[float]]:
    """The watchdog's own table: ``op -> [torch, deepshard, watchdog, via_logger]`` in us."""
    return {
        m[1]: [float(x) for x in m.group(2, 3, 4, 5)]
        for m in re.finditer(r"^(\w+)\s+([\d.]+) us\s+([\d.]+) us\s+([\d.]+) us\s+([\d.]+) us",
                             out, re.M)
    }  # fmt: skip


def test_run_quick_collects_both_suites_into_table_json_and_docs(tmp_path: Path) -> None:
    out_json, docs = tmp_path / "bench.json", tmp_path / "docs"
    command = [sys.executable, str(RUN), "watchdog", "profiler", "--quick", "--json"]
    command += [str(out_json), "--docs", "--docs-dir", str(docs), "--note", "smoke test"]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=150)
    out = done.stdout
    assert done.returncode == 0, out + done.stderr[-3000:]
    printed = {(m[1], m[2], m[3]): m for m in ROW.finditer(out)}
    result = json.loads(out_json.read_text())
    reports = {r["suite"]: r for r in result["suites"]}
    assert set(reports) == {"watchdog", "profiler"}

    # Watchdog: 3 rounds per op, paired; the suite's printed medians are over the same rounds.
    medians = _watchdog_medians(reports["watchdog"]["output"])
    assert set(medians) == {"all_reduce", "all_reduce_async", "reduce_scatter_tensor"}, out
    for op, (torch_us, *_ours) in medians.items():
        figures = reports["watchdog"]["figures"]
        assert statistics.median(figures[f"torch {op}"]["time_s"]) * 1e6 == pytest.approx(
            torch_us, abs=0.06
        )
        row = printed[("watchdog", f"deepshard {op}", f"torch {op}")]
        ratios = [a / b for a, b in zip(figures[f"deepshard {op}"]["time_s"],
                                        figures[f"torch {op}"]["time_s"], strict=True)]  # fmt: skip
        assert row[8] == "3"
        assert float(row[5]) == pytest.approx(min(ratios), abs=6e-4)
        assert float(row[6]) == pytest.approx(statistics.median(ratios), abs=6e-4)
        assert float(row[7]) == pytest.approx(max(ratios), abs=6e-4)

    # Profiler: its printed per-variant medians (ms) are the medians of the JSON's rounds, and a
    # missing DeepSpeed is said, not fatal.
    prof = reports["profiler"]
    variants = re.findall(r"^(\S+)\s+([\d.]+)\s+[\d.]+x$", prof["output"], re.M)
    assert {"plain", "deepshard", "deepshard-fwd"} <= {v for v, _ in variants}, prof["output"]
    for variant, ms in variants:
        assert 1e3 * statistics.median(prof["figures"][variant]["time_s"]) == pytest.approx(
            float(ms), abs=0.006
        )
    assert ("profiler", "deepshard", "plain") in printed
    if "deepspeed" in prof["missing"]:
        assert "profiler: deepspeed missing" in out
    else:
        assert ("profiler", "deepshard-fwd", "deepspeed") in printed

    # The JSON table is the printed table; the page holds it, the machine and the note.
    assert len(result["table"]) == len(printed)
    page = (docs / "benchmarks.md").read_text()
    for row in printed.values():
        assert row[0] in page
    for key in ("cpu", "torch", "python", "date"):
        assert str(result["machine"][key]) in page
    assert "Note: smoke test" in page
    png = docs / "benchmarks.png"
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert not png.exists() and "matplotlib is not installed" in page
    else:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and "benchmarks.png" in page
