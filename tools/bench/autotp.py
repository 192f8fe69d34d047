"""AutoTP training step and memory: DeepShard TP=2 vs DeepSpeed AutoTP=2 and DTensor, 2 gloo ranks.

    uv run --all-packages --group bench python tools/bench/autotp.py [--quick]
        [--steps 4] [--warmup 1] [--rounds 3] [--rows deepshard-tp2,...] [--json OUT]

Every row trains the same ~32M-parameter ``LlamaForCausalLM`` (`_autotp_worker.FULL`: hidden
512, intermediate 1408, 8 layers, 8 query / 4 KV heads, vocabulary 8192, untied; fp32 on CPU,
one thread per rank) from the same seed, on the same batch of 2 x 128 tokens per step on both
ranks (a tensor-parallel group shares its batch), with AdamW (lr 1e-4, weight decay 0.01) and
no clipping:

* ``deepshard-tp2``: what a user writes, ``deepshard.engine.initialize`` with
  ``tensor_parallel: {autotp_size: 2}`` at ZeRO stage 0 (AutoTP picks the model's HF
  ``tp_plan``; the engine sums the partial-over-TP gradients at the step);
* ``deepspeed-tp2``: DeepSpeed 0.19.7's AutoTP training, ``deepspeed.initialize`` with the
  same config (``torch_adam``); when it cannot run here the report says
  ``skipped: deepspeed (<reason>)``;
* ``dtensor-tp2``: PyTorch's ``parallelize_module`` with the same plan written by hand
  (``RowwiseParallel`` embedding, ``ColwiseParallel`` q/k/v/gate/up and LM head with a
  replicated output, ``RowwiseParallel`` o/down) and ``torch.optim.AdamW`` over its DTensors;
* ``unsharded``: the whole model on one rank with ``torch.optim.AdamW``: the memory reference.

Each row runs as rank processes forked from a server that imported torch, transformers,
DeepShard and DeepSpeed once. ``--rounds`` repetitions of the line-up run in rotated order, so
a busy phase of the shared machine hits every row. A step's time is rank 0's wall time for
forward + backward + optimizer step (``zero_grad`` included); the table gives the fastest and
the median over all timed steps of all rounds, and the step-time ratios use the fastest (the
one least disturbed by neighbours, as ``timeit`` does), the median ratio beside it. Memory per
rank (the larger rank's, the largest round's) is the bytes of the parameters the rank holds
and its peak resident-set growth (`_autotp_worker`). Targets, each MET or MISSED:
``deepshard-tp2`` step time <= 1.0x ``deepspeed-tp2``'s and <= 1.0x ``dtensor-tp2``'s;
parameter bytes per rank <= 0.55x ``unsharded``'s (half, plus the replicated norms and the
rounding of uneven splits). As a sanity check every row's first loss must equal
``unsharded``'s to 1e-4 relative.

Exit status: 0 when every row but DeepSpeed's ran (missed targets included); 1 otherwise.
"""

from __future__ import annotations

import argparse
import importlib.util
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import _autotp_worker
import _bench_json
import _ranks

ROWS = ("deepshard-tp2", "deepspeed-tp2", "dtensor-tp2", "unsharded")
OURS = "deepshard-tp2"
RANK_TIMEOUT_S = 900.0
QUICK_RANK_TIMEOUT_S = 120.0
MIB = float(1 << 20)
# (theirs, row key, what, target): the ratios ``deepshard-tp2`` / ``theirs`` the report prints.
CHECKS = (
    ("deepspeed-tp2", "best", "step time", 1.0),
    ("dtensor-tp2", "best", "step time", 1.0),
    ("unsharded", "param", "parameter bytes", 0.55),
    ("deepspeed-tp2", "median", "median step time", None),
    ("dtensor-tp2", "median", "median step time", None),
    ("unsharded", "best", "step time", None),
    ("deepspeed-tp2", "param", "parameter bytes", None),
    ("dtensor-tp2", "param", "parameter bytes", None),
    ("deepspeed-tp2", "rss", "peak RSS growth", None),
    ("dtensor-tp2", "rss", "peak RSS growth", None),
    ("unsharded", "rss", "peak RSS growth", None),
)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line; ``--quick`` is the smoke size (the issue's tiny Llama, one round)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny Llama, 1 round of 1 + 2 steps")
    parser.add_argument("--steps", type=int, help="timed steps per round (default 4)")
    parser.add_argument("--warmup", type=int, help="untimed steps first (default 1)")
    parser.add_argument("--rounds", type=int, help="line-up repetitions (default 3)")
    parser.add_argument("--rows", help=f"a subset of {','.join(ROWS)}")
    parser.add_argument("--json", type=Path, help="also write the ratios as JSON (for run.py)")
    args = parser.parse_args(argv)
    defaults = {"steps": 2, "rounds": 1} if args.quick else {}
    for key, value in {"steps": 4, "warmup": 1, "rounds": 3, **defaults}.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.rows = [r.strip() for r in args.rows.split(",")] if args.rows else list(ROWS)
    unknown = sorted(set(args.rows) - set(ROWS))
    if unknown:
        parser.error(f"unknown rows {unknown}; choose from {','.join(ROWS)}")
    if args.steps < 1 or args.rounds < 1 or args.warmup < 0:
        parser.error("--steps and --rounds must be >= 1, --warmup >= 0")
    return args


def _run_row(ctx: Any, row: str, args: argparse.Namespace, folder: Path) -> list[dict[str, Any]]:
    """Runs one row once on its ranks; returns each rank's report (or its error)."""
    world = _autotp_worker.WORLDS[row]
    stem = folder / f"{row}-{time.monotonic_ns()}"
    jobs = [
        _autotp_worker.RankJob(
            row, rank, world, f"{stem}.store", args.quick, args.warmup, args.steps,
            f"{stem}-{rank}.json",
        )
        for rank in range(world)
    ]  # fmt: skip
    timeout_s = QUICK_RANK_TIMEOUT_S if args.quick else RANK_TIMEOUT_S
    return _ranks.reports_or_errors(
        jobs, _ranks.run_ranks(ctx, _autotp_worker.run_rank, jobs, timeout_s)
    )


def _summary(rounds: list[list[dict[str, Any]]]) -> dict[str, Any]:
    """One row's figures over its rounds: times of rank 0, memory of the larger rank."""
    errors = [r["error"] for reports in rounds for r in reports if "error" in r]
    if errors:
        return {"error": errors[0]}
    times = sorted(t for reports in rounds for t in reports[0]["times"])
    return {
        "best": times[0] * 1e3,
        "median": statistics.median(times) * 1e3,
        "round_best": [min(reports[0]["times"]) * 1e3 for reports in rounds],
        "param": max(r["param_bytes"] for reports in rounds for r in reports) / MIB,
        "rss": max(r["rss_delta"] or 0 for reports in rounds for r in reports) / MIB,
        "ranks": len(rounds[0]),
        "params": rounds[0][0]["params"],
        "loss": rounds[0][0]["losses"][0],
    }


def _table(rows: dict[str, dict[str, Any]]) -> list[str]:
    lines = [
        "| row | ranks | best ms | median ms | parameter MiB/rank | peak RSS growth MiB/rank "
        "| first loss |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, row in rows.items():
        if "error" not in row:
            lines.append(
                f"| {name} | {row['ranks']} | {row['best']:.2f} | {row['median']:.2f} "
                f"| {row['param']:.3f} | {row['rss']:.1f} | {row['loss']:.6f} |"
            )
    return lines


def _verdicts(rows: dict[str, dict[str, Any]]) -> list[str]:
    ours = rows.get(OURS)
    lines = []
    for theirs, key, what, target in CHECKS:
        other = rows.get(theirs)
        if ours is None or other is None or "error" in ours or "error" in other:
            continue
        ratio = ours[key] / other[key]
        lines.append(f"{OURS} / {theirs}: {what} ratio {ratio:.3f} {_ranks.verdict(ratio, target)}")
    return lines


def _losses_agree(rows: dict[str, dict[str, Any]]) -> list[str]:
    base = rows.get("unsharded")
    if base is None or "error" in base:
        return []
    bad = []
    for name, row in rows.items():
        if "error" not in row and abs(row["loss"] - base["loss"]) > 1e-4 * abs(base["loss"]):
            bad.append(f"{name}'s first loss {row['loss']:.6f} != unsharded's {base['loss']:.6f}")
    return bad


def _write_json(path: Path | None, rows: dict[str, dict[str, Any]]) -> None:
    """Step-time ratios per paired round (fastest step each), memory ratios once."""
    ok = {name: row for name, row in rows.items() if "error" not in row}
    ratios = []
    for theirs, key, what, _ in CHECKS:
        if OURS not in ok or theirs not in ok or key == "median":
            continue
        if key == "best":
            values = _bench_json.paired_ratios(ok[OURS]["round_best"], ok[theirs]["round_best"])
        else:
            values = [ok[OURS][key] / ok[theirs][key]] if ok[theirs][key] else []
        ratios.append(_bench_json.ratio_row(OURS, theirs, what, values))
    figures = {
        n: {"time_s": [t / 1e3 for t in r["round_best"]], "peak_mib": r["rss"]}
        for n, r in ok.items()
    }
    missing = {n: r["error"].splitlines()[0][:300] for n, r in rows.items() if "error" in r}
    _bench_json.write(path, "autotp", ratios, figures, missing)


def _context(rows: list[str]) -> Any:
    ctx = multiprocessing.get_context("forkserver")
    # What the rows import lazily is preloaded, so no row's RSS growth or first step counts it.
    preload = ["torch", "torch.distributed", "torch.distributed.tensor.parallel"]
    preload += ["transformers.models.llama.modeling_llama", "_autotp_worker", "deepshard.engine"]
    if "deepspeed-tp2" in rows and importlib.util.find_spec("deepspeed") is not None:
        preload.append("deepspeed")
    ctx.set_forkserver_preload(preload)
    return ctx


def main(argv: list[str] | None = None) -> int:
    """Runs the rows in interleaved rounds and prints the report; returns the exit status."""
    args = parse_args(argv)
    ctx = _context(args.rows)
    shape = _autotp_worker.QUICK if args.quick else _autotp_worker.FULL
    print(
        f"Llama {shape}, fp32, 1 thread per rank, {args.warmup} warm-up + {args.steps} timed "
        f"steps x {args.rounds} round(s); step = forward + backward + AdamW step; "
        f"load average {os.getloadavg()[0]:.1f}",
        flush=True,
    )
    results: dict[str, list[list[dict[str, Any]]]] = {row: [] for row in args.rows}
    with tempfile.TemporaryDirectory(prefix="autotp-bench-") as folder:
        for index in range(args.rounds):
            shift = index % len(args.rows)
            for row in args.rows[shift:] + args.rows[:shift]:
                print(f"running {row} (round {index + 1})", file=sys.stderr, flush=True)
                start = time.monotonic()
                results[row].append(_run_row(ctx, row, args, Path(folder)))
                print(f"  {time.monotonic() - start:.1f} s", file=sys.stderr, flush=True)
    rows = {row: _summary(rounds) for row, rounds in results.items()}
    params = next((r["params"] for r in rows.values() if "params" in r), 0)
    print(f"{params / 1e6:.2f}M parameters; load average at the end {os.getloadavg()[0]:.1f}")
    for line in _table(rows) + _verdicts(rows):
        print(line)
    for name, row in rows.items():
        if "error" in row:
            label = "deepspeed" if name.startswith("deepspeed") else name
            print(f"skipped: {label} ({row['error'].splitlines()[0][:300]})")
    _write_json(args.json, rows)
    disagreements = _losses_agree(rows)
    for line in disagreements:
        print(f"ERROR: {line}")
    failed = [n for n, r in rows.items() if "error" in r and not n.startswith("deepspeed")]
    return 1 if failed or disagreements else 0


if __name__ == "__main__":
    sys.exit(main())
