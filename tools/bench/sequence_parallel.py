"""Ulysses sequence parallelism: activation memory and step time of a tiny Llama, 2 gloo ranks.

    uv run --all-packages --group bench python tools/bench/sequence_parallel.py [--quick]
        [--seq 8192] [--steps 2] [--warmup 1] [--rows sp1,sp2,...]

Every row trains the same two-layer Llama (hidden 64, 4 query / 2 KV heads, intermediate 256,
vocabulary 4096, sdpa) with AdamW on one sequence of ``--seq`` tokens per data-parallel replica
(an eighth of its labels masked), on 2 CPU ranks over gloo, through each library's engine:

* ``sp1``: DeepShard with ``sequence_parallel_size: 1`` — plain data parallelism (DDP-like),
  each rank holds a whole sequence;
* ``sp1-tiled``: the same with the ``sequence_parallel`` section's tiled MLP and tiled logits
  loss (8 slices);
* ``sp2``: DeepShard with ``sequence_parallel_size: 2`` — the two ranks share one sequence;
* ``sp2-tiled``: sp 2 with tiled MLP and logits loss;
* ``deepspeed-sp2``: DeepSpeed 0.19.7's ALST (``UlyssesSPAttentionHF.register_with_transformers``
  and its token-weighted loss recipe), when the ``bench`` group is installed and it runs on
  CPU/gloo; otherwise the reason is printed.

Per row: the fastest and the median timed step (rank 0's wall time for forward + backward +
optimizer step), the activation peak per rank (the larger rank's; tensor-byte accounting in one
extra untimed step, see `_sp_worker`), the logits peak per rank (LM head + loss alone) and
the first step's loss.
Targets, each MET or MISSED: activation peak per rank of ``sp2`` <= 0.55x ``sp1``'s; the tiled
loss cuts the logits peak >= 2x (``sp1`` / ``sp1-tiled`` and ``sp2`` / ``sp2-tiled``). As a
sanity check the first step's loss of every row must equal ``sp1``'s rank 0 (the same weights
and sequence) to 1e-4.

Exit status: 0 when every DeepShard row ran (missed targets included); 1 otherwise.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("DEEPSHARD_ACCELERATOR", "cpu")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import _bench_json
import _ranks
import _sp_worker

WORLD = 2
ROWS = ("sp1", "sp1-tiled", "sp2", "sp2-tiled", "deepspeed-sp2")
RANK_TIMEOUT_S = 600.0
MIB = float(1 << 20)
# (ours, theirs, row key, what, comparison, target): the ratios the report prints.
CHECKS = (
    ("sp2", "sp1", "peak", "activation peak", "<=", 0.55),
    ("sp1-tiled", "sp1", "logits", "logits peak", "<=", 0.5),
    ("sp2-tiled", "sp2", "logits", "logits peak", "<=", 0.5),
    ("sp2-tiled", "sp1", "peak", "activation peak", None, None),
    ("sp2", "sp1", "best", "step time", None, None),
    ("sp2-tiled", "sp2", "best", "step time", None, None),
    ("sp2", "deepspeed-sp2", "best", "step time", None, None),
    ("sp2", "deepspeed-sp2", "peak", "activation peak", None, None),
)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line; ``--quick`` is the smoke size (1,024 tokens, 1 + 1 steps)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="1024 tokens, 1 warm-up + 1 step")
    parser.add_argument("--seq", type=int, help="tokens per sequence (default 8192)")
    parser.add_argument("--steps", type=int, help="timed steps (default 2)")
    parser.add_argument("--warmup", type=int, help="untimed steps first (default 1)")
    parser.add_argument("--rows", help=f"a subset of {','.join(ROWS)}")
    parser.add_argument("--json", type=Path, help="also write the ratios as JSON (for run.py)")
    args = parser.parse_args(argv)
    defaults = {"seq": 1024, "steps": 1, "warmup": 1} if args.quick else {}
    for key, value in {"seq": 8192, "steps": 2, "warmup": 1, **defaults}.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.rows = [r.strip() for r in args.rows.split(",")] if args.rows else list(ROWS)
    unknown = sorted(set(args.rows) - set(ROWS))
    if unknown:
        parser.error(f"unknown rows {unknown}; choose from {','.join(ROWS)}")
    if args.seq % WORLD or args.steps < 1 or args.warmup < 0:
        parser.error(f"--seq must be a multiple of {WORLD}; --steps >= 1, --warmup >= 0")
    return args


def _run_row(ctx: Any, row: str, args: argparse.Namespace, folder: Path) -> list[dict[str, Any]]:
    """Runs one row on ``WORLD`` ranks; returns each rank's report (or its error)."""
    jobs = [
        _sp_worker.RankJob(
            row,
            rank,
            WORLD,
            str(folder / f"{row}.store"),
            args.seq,
            args.warmup,
            args.steps,
            str(folder / f"{row}-{rank}.json"),
        )
        for rank in range(WORLD)
    ]
    exitcodes = _ranks.run_ranks(ctx, _sp_worker.run_rank, jobs, RANK_TIMEOUT_S)
    return _ranks.reports_or_errors(jobs, exitcodes)


def _summary(reports: list[dict[str, Any]]) -> dict[str, Any]:
    errors = [r["error"] for r in reports if "error" in r]
    if errors:
        return {"error": errors[0]}
    times = sorted(reports[0]["times"])
    return {
        "best": times[0],
        "median": times[len(times) // 2],
        "peak": max(r["peak"] for r in reports) / MIB,
        "logits": max(r["logits_peak"] for r in reports) / MIB,
        "loss": reports[0]["losses"][0],
    }


def _table(rows: dict[str, dict[str, Any]]) -> list[str]:
    lines = [
        "| row | best s | median s | activation peak MiB/rank | logits peak MiB/rank "
        "| first loss |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for name, row in rows.items():
        if "error" in row:
            lines.append(f"| {name} | FAILED | - | - | - | - |")
            continue
        logits = f"{row['logits']:.1f}" if row["logits"] else "-"
        lines.append(
            f"| {name} | {row['best']:.3f} | {row['median']:.3f} | {row['peak']:.1f} | "
            f"{logits} | {row['loss']:.6f} |"
        )
    return lines


def _verdicts(rows: dict[str, dict[str, Any]]) -> list[str]:
    lines = []
    for ours, theirs, key, what, _, target in CHECKS:
        a, b = rows.get(ours), rows.get(theirs)
        if a is None or b is None or "error" in a or "error" in b:
            continue
        ratio = a[key] / b[key]
        lines.append(f"{ours} / {theirs}: {what} ratio {ratio:.3f} {_ranks.verdict(ratio, target)}")
    return lines


def _losses_agree(rows: dict[str, dict[str, Any]]) -> list[str]:
    base = rows.get("sp1")
    if base is None or "error" in base:
        return []
    bad = []
    for name, row in rows.items():
        off = "error" not in row and abs(row["loss"] - base["loss"]) > 1e-4 * abs(base["loss"])
        if name != "sp1" and off:
            bad.append(f"{name}'s first loss {row['loss']:.6f} != sp1's {base['loss']:.6f}")
    return bad


def _write_json(path: Path | None, rows: dict[str, dict[str, Any]]) -> None:
    """Each printed ratio (one run, so one value each) and every row's own figures."""
    ok = {name: row for name, row in rows.items() if "error" not in row}
    ratios = [
        _bench_json.ratio_row(ours, theirs, what, [ok[ours][key] / ok[theirs][key]])
        for ours, theirs, key, what, _, _ in CHECKS
        if ours in ok and theirs in ok and ok[theirs][key]
    ]
    figures = {n: {"time_s": [r["best"]], "peak_mib": r["peak"]} for n, r in ok.items()}
    missing = {n: r["error"].splitlines()[0][:300] for n, r in rows.items() if "error" in r}
    _bench_json.write(path, "sequence_parallel", ratios, figures, missing)


def main(argv: list[str] | None = None) -> int:
    """Runs the rows and prints the report; returns the exit status."""
    args = parse_args(argv)
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "_sp_worker", "deepshard.engine"])
    print(
        f"world {WORLD} gloo ranks, 1 thread each, {args.seq} tokens, {args.warmup} warm-up + "
        f"{args.steps} timed steps, load average {os.getloadavg()[0]:.1f}",
        flush=True,
    )
    rows: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="sp-bench-") as folder:
        for row in args.rows:
            print(f"running {row}", file=sys.stderr, flush=True)
            start = time.monotonic()
            rows[row] = _summary(_run_row(ctx, row, args, Path(folder)))
            print(f"  {time.monotonic() - start:.1f} s", file=sys.stderr, flush=True)
    for line in _table(rows) + _verdicts(rows):
        print(line)
    for name, row in rows.items():
        if "error" in row:
            print(f"{name} could not run: {row['error'].splitlines()[0][:300]}")
    _write_json(args.json, rows)
    disagreements = _losses_agree(rows)
    for line in disagreements:
        print(f"ERROR: {line}")
    failed = [n for n, r in rows.items() if "error" in r and not n.startswith("deepspeed")]
    return 1 if failed or disagreements else 0


if __name__ == "__main__":
    sys.exit(main())
