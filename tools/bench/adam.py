"""CPU Adam throughput: DeepShard vs DeepSpeed vs torch.optim.AdamW, against STREAM triad.

    uv run --all-packages --group bench python tools/bench/adam.py [--quick] [--sizes 10M,100M]
        [--threads 1,2] [--steps 10] [--rounds 3] [--competitors deepshard,deepspeed]
        [--dtype fp32|bf16|fp16]

One fp32 AdamW step over a flat tensor moves 28 bytes per parameter: it reads p, g, m and v and
writes p, m and v back to the lines it has just read (so no write-allocate traffic). Effective
GB/s is those 28 bytes over the median step time, and that figure is also shown as a fraction
of the STREAM triad bandwidth measured in the same process, with the same thread count, in
bursts right before and after the row (see `_stream_triad` for how triad bytes are counted).

Each thread count runs in its own worker process started with ``OMP_NUM_THREADS`` set, so
every competitor (and the triad) gets exactly that many threads; the ``busy`` column (threads
on a CPU for at least a quarter of the timed steps) and ``cpu/wall`` (CPU seconds per wall
second) show how many cores a row really kept busy.
Competitors run one after another, their state freed in between; with ``--rounds`` > 1 the
whole line-up runs again in a rotated order and a row's median covers every timed step, which
evens out other processes' load on a shared machine.

Exit status: 0 when every competitor ran (a missed target prints MISSED, it is not an error);
1 when a competitor could not run (unless ``--skip-missing``) or computed a wrong update.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import _bench_json
import _host
from _adam_spec import DTYPES, HYPER_PARAMETERS, NAMES, bytes_per_param

BANDWIDTH_TARGET = 0.80  # of STREAM triad, at sizes of at least _BANDWIDTH_TARGET_SIZE
_BANDWIDTH_TARGET_SIZE = 100_000_000
_SUFFIXES = {"K": 10**3, "M": 10**6, "G": 10**9}


def parse_count(text: str) -> int:
    """``"10M"`` -> 10_000_000 (decimal K/M/G suffixes; plain integers too)."""
    text = text.strip().upper()
    scale = _SUFFIXES.get(text[-1:], 1)
    number = text[:-1] if text[-1:] in _SUFFIXES else text
    try:
        value = int(float(number) * scale)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a count such as 10M or 1000") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be at least 1")
    return value


def _count_list(text: str) -> list[int]:
    return [parse_count(part) for part in text.split(",") if part.strip()]


def _non_negative(text: str) -> int:
    return 0 if text.strip() == "0" else parse_count(text)


def _name_list(text: str) -> list[str]:
    names = [part.strip() for part in text.split(",") if part.strip()]
    unknown = sorted(set(names) - set(NAMES))
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown {unknown}; choose from {NAMES}")
    return names


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line; ``--quick`` fills in small defaults for a smoke run."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=_count_list, help="parameter counts (default 10M,100M)")
    parser.add_argument("--threads", type=_count_list, default=[1, 2], help="default 1,2")
    parser.add_argument("--steps", type=parse_count, help="timed steps per round (default 10)")
    parser.add_argument("--warmup", type=_non_negative, help="untimed steps (default 3)")
    parser.add_argument("--rounds", type=parse_count, help="line-up repetitions (default 3)")
    parser.add_argument("--competitors", type=_name_list)
    parser.add_argument(
        "--dtype", choices=DTYPES, default="fp32",
        help="parameter and gradient dtype, updated in place with fp32 moments (default fp32); "
        "16-bit races only deepshard and deepspeed unless --competitors says otherwise",
    )  # fmt: skip
    parser.add_argument("--quick", action="store_true", help="1M params, 1 round: a smoke run")
    parser.add_argument(
        "--skip-missing", action="store_true", help="exit 0 when a competitor cannot run here"
    )
    parser.add_argument("--json", type=Path, help="also write the ratios as JSON (for run.py)")
    parser.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--worker-out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    quick = args.quick
    args.sizes = args.sizes or ([1_000_000] if quick else [10_000_000, 100_000_000])
    args.steps = args.steps or (3 if quick else 10)
    args.warmup = args.warmup if args.warmup is not None else (1 if quick else 3)
    args.rounds = args.rounds or (1 if quick else 3)
    # torch.optim keeps 16-bit moments for 16-bit parameters: other work, so not raced there.
    args.competitors = args.competitors or (
        list(NAMES) if args.dtype == "fp32" else ["deepshard", "deepspeed"]
    )
    return args


def _spawn_worker(args: argparse.Namespace, argv: list[str], threads: int) -> dict[str, Any]:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    env["DS_ACCELERATOR"] = "cpu"
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "result.json"
        command = [sys.executable, __file__, *argv, "--worker", str(threads), "--worker-out"]
        # The worker's stdout (DeepSpeed's build chatter) joins our stderr: stdout is the report.
        status = subprocess.run([*command, str(out)], env=env, stdout=sys.stderr, check=False)
        result: dict[str, Any] = (
            json.loads(out.read_text())
            if out.exists()
            else {"threads": threads, "rows": [], "missing": {}, "wrong": {}, "backends": {}}
        )
    if status.returncode != 0:
        result["crash"] = f"the {threads}-thread worker exited with status {status.returncode}"
    return result


def _fmt_count(count: int) -> str:
    for suffix, scale in (("G", 10**9), ("M", 10**6), ("K", 10**3)):
        if count >= scale and count % (scale // 100) == 0:
            return f"{count / scale:g}{suffix}"
    return str(count)


def _gbps(row: dict[str, Any]) -> float:
    return float(row["bytes_per_param"] * row["params"] / row["seconds"] / 1e9)


def _print_bandwidth(results: list[dict[str, Any]]) -> None:
    for result in results:
        bursts, threads = result.get("triad_bursts", []), result["threads"]
        if not bursts:
            continue
        best, counted = max(bursts), result["triad_bytes_per_element"]
        moved = best * result["triad_write_allocate_factor"]
        print(
            f"STREAM triad, {_threads(threads)}: {best:.1f} GB/s best of {len(bursts)} bursts "
            f"(worst {min(bursts):.1f}); {counted} B/elem as STREAM counts, write-allocate not "
            f"counted ({moved:.1f} GB/s if it were); {result['triad_implementation']}"
        )


def _threads(count: int) -> str:
    return f"{count} thread{'s' if count > 1 else ''}"


def _print_table(rows: list[dict[str, Any]], cache_bytes: int) -> None:
    columns = ["optimizer", "params", "threads", "s/step", "GB/s", "of triad", "triad GB/s"]
    columns += ["busy", "cpu/wall"]
    print("| " + " | ".join(columns) + " |")
    print("|---" + "|---:" * (len(columns) - 1) + "|")
    for row in rows:
        busy = row["busy_threads"]
        flag = " !" if busy is not None and busy < row["threads"] else ""
        cached = " ~" if row["bytes_per_param"] * row["params"] < 4 * cache_bytes else ""
        print(
            f"| {row['name']} | {_fmt_count(row['params'])}{cached} | {row['threads']} "
            f"| {row['seconds']:.4g} | {_gbps(row):.1f} | {_gbps(row) / row['triad']:.0%} "
            f"| {row['triad']:.1f} | {'-' if busy is None else busy}{flag} "
            f"| {row['cpu_per_wall']:.2f} |"
        )


def _verdicts(rows: list[dict[str, Any]], threads: list[int], sizes: list[int]) -> list[str]:
    by_key = {(row["name"], row["params"], row["threads"]): row for row in rows}
    lines = []
    for size in sizes:
        for count in threads:
            where = f"{_fmt_count(size)} params, {_threads(count)}"
            ours = by_key.get(("deepshard", size, count))
            theirs = by_key.get(("deepspeed", size, count))
            if ours is None or theirs is None:
                lines.append(f"DeepShard >= DeepSpeed, {where}: NOT EVALUATED (a side did not run)")
            else:
                ratio = _gbps(ours) / _gbps(theirs)
                verdict = "MET" if ratio >= 1 else f"MISSED by {1 - ratio:.1%}"
                lines.append(
                    f"DeepShard >= DeepSpeed, {where}: {_gbps(ours):.1f} vs "
                    f"{_gbps(theirs):.1f} GB/s ({ratio - 1:+.1%}): {verdict}"
                )
            if size >= _BANDWIDTH_TARGET_SIZE:
                lines.append(_bandwidth_verdict(ours, where))
    return lines


def _bandwidth_verdict(ours: dict[str, Any] | None, where: str) -> str:
    label = f"DeepShard >= {BANDWIDTH_TARGET:.0%} of STREAM triad, {where}"
    if ours is None:
        return f"{label}: NOT EVALUATED (deepshard did not run)"
    fraction = _gbps(ours) / ours["triad"]
    if fraction >= BANDWIDTH_TARGET:
        return f"{label}: {fraction:.0%}: MET"
    short = 100 * (BANDWIDTH_TARGET - fraction)
    return f"{label}: {fraction:.0%}: MISSED by {short:.0f} percentage points"


def _report(args: argparse.Namespace, results: list[dict[str, Any]], load: float) -> int:
    """Prints bandwidth, table, verdicts and problems; returns the exit status."""
    print(f"CPU Adam step, {args.dtype} parameters and gradients, fp32 moments, "
          f"{HYPER_PARAMETERS}, bias correction on")  # fmt: skip
    torch_version = next((result["torch"] for result in results if "torch" in result), "?")
    print(f"host: {_host.cpu_description()}, {os.cpu_count()} CPUs, torch {torch_version}, "
          f"load average {load:.2f} at start")  # fmt: skip
    print(
        f"GB/s = {bytes_per_param(args.dtype)} B/param (read p, g, m, v; write p, m, v) / "
        "median s/step. "
        "'of triad' divides by the best triad burst next to the row; triad counts 24 B/elem and "
        "no write-allocate, Adam has none to count, so it can pass 100%. "
        "'busy' = threads that were on a CPU for at least a quarter of the timed steps; '!' marks "
        "fewer than asked (the kernel ran serially, or other processes held the cores). "
        "'cpu/wall' = process CPU seconds per wall second over the timed steps. "
        "'~' after params: the state is under 4x the last-level cache, so caches serve part of "
        "it and the bandwidth figures overstate DRAM throughput."
    )
    backends = {name: text for result in results for name, text in result["backends"].items()}
    for name, text in backends.items():
        print(f"{name}: {text}")
    _print_bandwidth(results)
    print()
    rows = [row for result in results for row in result["rows"]]
    _print_table(rows, max(result.get("cache_bytes", 0) for result in results))
    print()
    verdicts = _verdicts(rows, args.threads, args.sizes)
    for line in verdicts:
        print(line)
    met = sum(line.endswith(": MET") for line in verdicts)
    missed = sum(": MISSED" in line for line in verdicts)
    print(f"targets: {met} MET, {missed} MISSED, {len(verdicts) - met - missed} NOT EVALUATED")
    _write_json(args.json, rows, results)
    return _problems(args, results)


def _write_json(
    path: Path | None, rows: list[dict[str, Any]], results: list[dict[str, Any]]
) -> None:
    """Per size and thread count, DeepShard's round-by-round time over each competitor's."""
    by_key = {(row["name"], row["params"], row["threads"]): row for row in rows}
    ratios, figures = [], {}
    for (name, params, threads), row in by_key.items():
        where = f"{_fmt_count(params)} params, {_threads(threads)}"
        figures[f"{name} {where}"] = {"time_s": row["round_seconds"], "peak_mib": None}
        ours = by_key.get(("deepshard", params, threads))
        if name == "deepshard" or ours is None:
            continue
        series = _bench_json.paired_ratios(ours["round_seconds"], row["round_seconds"])
        ratios.append(_bench_json.ratio_row(f"deepshard {where}", f"{name} {where}",
                                            "step time", series))  # fmt: skip
    missing = {name: reason for result in results for name, reason in result["missing"].items()}
    _bench_json.write(path, "adam", ratios, figures, missing)


def _problems(args: argparse.Namespace, results: list[dict[str, Any]]) -> int:
    """Prints who could not run or computed a wrong update; returns the exit status."""
    missing: dict[tuple[str, str], list[int]] = {}
    wrong: dict[tuple[str, str], list[int]] = {}
    for result in results:
        for name, reason in result["missing"].items():
            missing.setdefault((name, reason), []).append(result["threads"])
        for name, reason in result["wrong"].items():
            wrong.setdefault((name, reason), []).append(result["threads"])
    action = "skipped" if args.skip_missing else "ERROR (pass --skip-missing to race the rest)"
    for (name, reason), threads in missing.items():
        print(f"{action}: {name} could not run (threads {threads}): {reason}")
    for (name, reason), threads in wrong.items():
        print(f"ERROR: {name} computes a wrong update (threads {threads}): {reason}")
    crashes = [result["crash"] for result in results if "crash" in result]
    for crash in crashes:
        print(f"ERROR: {crash}; its output above says why")
    return 1 if wrong or crashes or (missing and not args.skip_missing) else 0


def main(argv: list[str] | None = None) -> int:
    """Runs the benchmark (or, with the hidden ``--worker``, one thread count of it)."""
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.worker is not None:
        import _adam_worker  # torch and the competitors load in the worker only

        plan = _adam_worker.Plan(
            args.worker, args.competitors, args.sizes, args.warmup, args.steps, args.rounds,
            args.dtype,
        )  # fmt: skip
        _adam_worker.run(plan, args.worker_out)
        return 0
    load = os.getloadavg()[0]
    results = [_spawn_worker(args, argv, threads) for threads in args.threads]
    return _report(args, results, load)


if __name__ == "__main__":
    sys.exit(main())
