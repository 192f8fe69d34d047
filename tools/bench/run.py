"""Every benchmark suite in one run: one table of DeepShard / competitor ratios, JSON, docs.

Each suite (``tools/bench/<suite>.py``) runs as a subprocess of its own, with ``--json`` so it
hands back its ratios and figures in one shape (`_bench_json`). The suites race their
competitors themselves, interleaving the repetitions so a busy phase of a shared machine hits
both sides; this script only runs them in turn and collects. A ratio is DeepShard's figure over
the competitor's (lower time or memory is better, so below 1 means DeepShard wins); where a suite
pairs its rounds the table gives the min, median and max over them, else the one ratio.

A suite whose competitor is not installed (DeepSpeed comes from the ``bench`` group) says so in
its ``missing`` list and still reports DeepShard's own figures. A suite that crashes, or writes
no JSON, is reported as failed and the others still run; the exit status is then 1.

``--docs`` renders ``docs/benchmarks.md`` (the table with the machine and versions it ran on)
and ``docs/benchmarks.png`` (step time and peak memory per ZeRO stage, and the ratios), which
needs matplotlib (in the ``bench`` group).

Run from the repository root::

    uv run --all-packages --group bench python tools/bench/run.py [suite ...] [--quick] [--docs]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import _bench_docs
import _host

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent


@dataclass(frozen=True)
class Suite:
    """One benchmark script and how `run.py` calls it."""

    name: str
    """What the command line and the table call it."""
    script: str
    """The file under ``tools/bench``."""
    args: tuple[str, ...] = ()
    """Its options for a full run."""
    quick: tuple[str, ...] = ()
    """Its options for ``--quick``: the smoke sizes."""


# Adding a suite is one line: it must accept ``--json PATH`` and write `_bench_json`'s shape.
SUITES = (
    Suite("adam", "adam.py", ("--skip-missing",), ("--quick", "--skip-missing")),
    Suite("zero", "zero.py", ("--stages", "0-2"), ("--quick", "--stages", "0-2")),
    Suite("zero3", "zero.py", ("--stages", "3"), ("--quick", "--stages", "3")),
    Suite("profiler", "profiler.py", (), ("--hidden", "32", "--layers", "1", "--batch", "1",
                                          "--seq", "16", "--steps", "1", "--rounds", "2")),
    Suite("launch", "launch.py", ("--runs", "5"), ("--runs", "1")),
    Suite("watchdog", "watchdog.py", (), ("--calls", "10", "--rounds", "3")),
    Suite("sequence_parallel", "sequence_parallel.py", (), ("--quick",)),
    Suite("checkpoint", "checkpoint.py", (), ("--quick",)),
    Suite("autotp", "autotp.py", (), ("--quick",)),
    Suite("autoep", "autoep.py", (), ("--quick",)),
    Suite("inference", "inference.py", (), ("--quick",)),
)  # fmt: skip
BY_NAME = {suite.name: suite for suite in SUITES}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line: suites to run (default all), ``--quick``, ``--json``, ``--docs``."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("suites", nargs="*", help=f"any of {', '.join(BY_NAME)} (default all)")
    parser.add_argument("--quick", action="store_true", help="each suite at its smoke size")
    parser.add_argument("--json", type=Path, help="write the table and machine as JSON here")
    parser.add_argument("--docs", action="store_true", help="render benchmarks.md and the plot")
    parser.add_argument("--docs-dir", type=Path, default=REPO / "docs", help="default docs/")
    parser.add_argument("--from-json", type=Path, help="render a saved --json run, run nothing")
    parser.add_argument("--note", help="a line for the docs page, e.g. that the box was shared")
    parser.add_argument("--timeout", type=float, default=7200.0, help="seconds per suite")
    args = parser.parse_args(argv)
    unknown = [name for name in args.suites if name not in BY_NAME]
    if unknown:
        parser.error(f"unknown suite(s) {unknown}; choose from {', '.join(BY_NAME)}")
    args.suites = [BY_NAME[name] for name in args.suites] if args.suites else list(SUITES)
    return args


def run_suite(suite: Suite, quick: bool, timeout_s: float, folder: Path) -> dict[str, Any]:
    """Runs one suite, echoes what it printed; returns its report plus exit status and output."""
    out = folder / f"{suite.name}.json"
    command = [sys.executable, str(HERE / suite.script), *(suite.quick if quick else suite.args)]
    command += ["--json", str(out)]
    print(f"== {suite.name}: {' '.join(command[1:])}", flush=True)
    start = time.monotonic()
    try:
        done = subprocess.run(
            command, cwd=REPO, stdout=subprocess.PIPE, text=True, timeout=timeout_s, check=False
        )
        code, output = done.returncode, done.stdout
    except subprocess.TimeoutExpired as error:
        code, output = None, str(error.stdout or "")
    print(output, end="", flush=True)
    seconds = time.monotonic() - start
    if not out.exists():
        why = "ran past --timeout" if code is None else f"exited {code} without writing its JSON"
        return {"suite": suite.name, "failed": why, "seconds": seconds, "output": output}
    report: dict[str, Any] = json.loads(out.read_text())
    return {**report, "exit": code, "seconds": seconds, "output": output}


def ratio_table(reports: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per ratio of every suite, with min/median/max over its values."""
    table = []
    for report in reports:
        for row in report.get("rows", []):
            values = row["ratios"]
            if not values:
                continue
            table.append({
                "suite": report["suite"], "ours": row["ours"], "theirs": row["theirs"],
                "measure": row["measure"], "min": min(values),
                "median": statistics.median(values), "max": max(values), "n": len(values),
            })  # fmt: skip
    return table


def table_lines(table: list[dict[str, Any]], reports: list[dict[str, Any]]) -> list[str]:
    """The markdown table, then who was missing and which suite failed."""
    lines = [
        "| suite | DeepShard | competitor | measure | min | median | max | values |",
        "| --- | --- | --- | --- | ---: | ---: | ---: | ---: |",
    ]
    for r in table:
        lines.append(
            f"| {r['suite']} | {r['ours']} | {r['theirs']} | {r['measure']} | {r['min']:.3f} "
            f"| {r['median']:.3f} | {r['max']:.3f} | {r['n']} |"
        )
    notes = []
    for report in reports:
        for name, reason in report.get("missing", {}).items():
            notes.append(f"- {report['suite']}: {name} missing ({reason}); DeepShard's own "
                         "figures are reported")  # fmt: skip
        if "failed" in report:
            notes.append(f"- {report['suite']}: FAILED ({report['failed']})")
        elif report.get("exit"):
            notes.append(f"- {report['suite']}: exited {report['exit']} (see its output)")
    return [*lines, "", *notes] if notes else lines


def machine() -> dict[str, Any]:
    """The machine and versions the run is on (read without importing torch here)."""
    from importlib import metadata

    def version(package: str) -> str:
        try:
            return metadata.version(package)
        except metadata.PackageNotFoundError:
            return "not installed"

    return {
        "cpu": _host.cpu_description(),
        "cores": os.cpu_count(),
        "load_average_at_start": round(os.getloadavg()[0], 2),
        "python": sys.version.split()[0],
        "torch": version("torch"),
        "deepspeed": version("deepspeed"),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }


def main(argv: list[str] | None = None) -> int:
    """Runs the suites, prints the table, writes the JSON and docs; returns the exit status."""
    args = parse_args(argv)
    if args.from_json is not None:  # re-render a saved run (its machine, not this one)
        result = json.loads(args.from_json.read_text())
        reports = result["suites"]
        result["note"] = args.note or result.get("note")
    else:
        host = machine()
        with tempfile.TemporaryDirectory(prefix="bench-run-") as folder:
            reports = [run_suite(s, args.quick, args.timeout, Path(folder)) for s in args.suites]
        result = {"machine": host, "quick": args.quick, "note": args.note, "suites": reports}
    result["table"] = ratio_table(reports)
    lines = table_lines(result["table"], reports)
    print("\nDeepShard / competitor (lower is better; min/median/max over the paired rounds)")
    print("\n".join(lines))
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=1))
        print(f"wrote {args.json}")
    if args.docs:
        for path in _bench_docs.render(result, lines, args.docs_dir):
            print(f"wrote {path}")
    return 1 if any("failed" in report for report in reports) else 0


if __name__ == "__main__":
    sys.exit(main())
