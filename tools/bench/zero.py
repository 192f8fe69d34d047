"""ZeRO training step: DeepShard stages 0/1/2 vs torch DDP and DeepSpeed ZeRO 0/1/2, 2 gloo ranks.

    uv run --all-packages --group bench python tools/bench/zero.py [--quick] [--steps 4]
        [--warmup 2] [--rounds 3] [--threads 1] [--competitors deepshard-0,ddp]

Every competitor trains the same ~10.5M-parameter GPT-style model (`_zero_model.FULL`) in fp32
on 2 CPU ranks over gloo, from the same initial weights, on the same token batches, with
``torch.optim.AdamW`` (lr 1e-3) and gradient clipping at 1.0:

* ``ddp``: ``torch.nn.parallel.DistributedDataParallel`` (bucketed all-reduce overlapping
  backward), ``clip_grad_norm_``, AdamW on the parameters;
* ``deepspeed-K``: DeepSpeed 0.19.7's engine with ``zero_optimization.stage`` K (0, 1, 2),
  ``DS_ACCELERATOR=cpu``, ``"torch_adam": true``;
* ``deepshard-K``: ``deepshard.engine.initialize`` with the same config.

Each competitor runs as a pair of rank processes forked from a server that imported torch,
DeepSpeed and DeepShard once, so import time is not raced. A rank trains ``warmup`` untimed and
``steps`` timed steps; a step's time is rank 0's wall time for forward, backward and optimizer
step. The table shows the fastest and the median step over all timed steps of ``--rounds``
repetitions of the line-up (in rotated order). The ratios the targets are about use the fastest
step, the one least disturbed by other load on a shared machine (as ``timeit`` does; the
median moves with the neighbours' load by tens of percent between runs): DeepShard stage K /
DeepSpeed stage K (target <= 1.0) and DeepShard stage 0 / DDP (target <= 1.1), each printed
MET or MISSED.

Memory per rank is the **peak resident-set growth** of the rank process (Linux ``VmHWM`` after
resetting it through ``/proc/self/clear_refs``, minus ``VmRSS`` at start), the larger of the two
ranks: what the process really touched for model, gradients, optimizer state, communication
buffers and activations, allocator included. DeepShard's rows also list its own tensor-byte
count (parameters, gradients, fp32 masters, optimizer state) from ``engine.memory_bytes()``.
As a sanity check every competitor's last loss must agree with DDP's to 1e-3 relative.

Exit status: 0 when every competitor ran (missed targets included), 1 when one failed or the
losses disagree.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import multiprocessing
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("DEEPSHARD_ACCELERATOR", "cpu")

import _zero_worker  # (after the environment above: it must be set before torch loads)

WORLD = 2
STAGES = (0, 1, 2)
NAMES = ("ddp", *(f"deepspeed-{s}" for s in STAGES), *(f"deepshard-{s}" for s in STAGES))
DEEPSPEED_TARGET = 1.0
DDP_TARGET = 1.1
LOSS_AGREEMENT = 1e-3
RANK_TIMEOUT_S = 600.0
DEFAULTS = {"steps": 4, "rounds": 3, "warmup": 2}
QUICK_DEFAULTS = {"steps": 2, "rounds": 1, "warmup": 1}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line; ``--quick`` is the smoke size: a tiny model, 1 + 2 steps."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny model, 1 warm-up + 2 steps")
    parser.add_argument("--steps", type=int, help="timed steps per round (default 4)")
    parser.add_argument("--warmup", type=int, help="untimed steps first (default 2)")
    parser.add_argument("--rounds", type=int, help="line-up repetitions (default 3)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument(
        "--competitors",
        type=lambda text: [n.strip() for n in text.split(",") if n.strip()],
        default=list(NAMES),
        help=f"a subset of {','.join(NAMES)}",
    )
    args = parser.parse_args(argv)
    unknown = sorted(set(args.competitors) - set(NAMES))
    if unknown:
        parser.error(f"unknown competitors {unknown}; choose from {NAMES}")
    for key, value in (QUICK_DEFAULTS if args.quick else DEFAULTS).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.steps < 1 or args.rounds < 1 or args.warmup < 0 or args.threads < 1:
        parser.error("--steps, --rounds and --threads must be >= 1, --warmup >= 0")
    return args


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _context(with_deepspeed: bool) -> Any:
    ctx = multiprocessing.get_context("forkserver")
    preload = ["torch", "torch.distributed", "_zero_model", "_zero_worker", "deepshard.engine"]
    if with_deepspeed:
        preload.append("deepspeed")
    ctx.set_forkserver_preload(preload)
    return ctx


def _race_one(ctx: Any, name: str, args: argparse.Namespace, folder: Path) -> list[dict[str, Any]]:
    """Runs one competitor on ``WORLD`` ranks; returns each rank's report."""
    port = _free_port()
    jobs = [
        _zero_worker.RankJob(
            name,
            rank,
            WORLD,
            port,
            args.threads,
            args.quick,
            args.warmup,
            args.steps,
            str(folder / f"{name}-{rank}.json"),
        )
        for rank in range(WORLD)
    ]
    processes = [ctx.Process(target=_zero_worker.run_rank, args=(job,)) for job in jobs]
    for process in processes:
        process.start()
    deadline = time.monotonic() + RANK_TIMEOUT_S
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))
    failed = [p.exitcode for p in processes if p.exitcode != 0]
    for process in processes:
        if process.is_alive():
            process.kill()
            process.join()
    if failed:
        for job in jobs:
            log = Path(job.out + ".log")
            text = log.read_text(errors="replace") if log.exists() else "(no output)"
            print(f"----- {name} rank {job.rank} output -----\n{text}", file=sys.stderr)
        raise RuntimeError(f"{name}: a rank exited with {failed} (its output is above)")
    return [json.loads(Path(job.out).read_text()) for job in jobs]


def _lineup(args: argparse.Namespace) -> tuple[list[str], list[str]]:
    if importlib.util.find_spec("deepspeed") is not None:
        return list(args.competitors), []
    skipped = [n for n in args.competitors if n.startswith("deepspeed")]
    return [n for n in args.competitors if n not in skipped], skipped


def _summarise(reports: list[list[dict[str, Any]]]) -> dict[str, Any]:
    times = [t for rounds in reports for t in rounds[0]["times"]]
    rss = [r["rss_delta"] for rounds in reports for r in rounds if r["rss_delta"] is not None]
    return {
        "best_s": min(times),
        "median_s": statistics.median(times),
        "rss_delta": max(rss) if rss else None,
        "losses": reports[-1][0]["losses"],
        "params": reports[-1][0]["params"],
        "tensor_bytes": reports[-1][0]["tensor_bytes"],
    }


def _mib(value: int | None) -> str:
    return "n/a" if value is None else f"{value / 2**20:.1f}"


def _print_table(rows: dict[str, dict[str, Any]]) -> None:
    print(
        "| competitor | best s/step | median s/step | peak RSS growth MiB/rank | first loss "
        "| last loss |"
    )
    print("| --- | --- | --- | --- | --- | --- |")
    for name, row in rows.items():
        losses = row["losses"]
        print(
            f"| {name} | {row['best_s']:.4f} | {row['median_s']:.4f} | {_mib(row['rss_delta'])} | "
            f"{losses[0]:.5f} | {losses[-1]:.5f} |"
        )
    for name, row in rows.items():
        counts = row["tensor_bytes"]
        if counts:
            parts = ", ".join(f"{k.replace('_', ' ')} {_mib(v)}" for k, v in counts.items())
            print(f"{name} tensor bytes per rank (MiB): {parts}")


def _verdicts(rows: dict[str, dict[str, Any]]) -> list[str]:
    lines = []
    pairs = [(f"deepshard-{s}", f"deepspeed-{s}", DEEPSPEED_TARGET) for s in STAGES]
    pairs.append(("deepshard-0", "ddp", DDP_TARGET))
    for ours, theirs, target in pairs:
        if ours not in rows or theirs not in rows:
            continue
        ratio = rows[ours]["best_s"] / rows[theirs]["best_s"]
        verdict = "MET" if ratio <= target else f"MISSED by {ratio - target:.3f}"
        memory = ""
        if rows[ours]["rss_delta"] and rows[theirs]["rss_delta"]:
            memory = f", memory ratio {rows[ours]['rss_delta'] / rows[theirs]['rss_delta']:.2f}"
        lines.append(
            f"{ours} / {theirs}: step time ratio {ratio:.3f} (target <= {target}): "
            f"{verdict}{memory}"
        )
    return lines


def _losses_agree(rows: dict[str, dict[str, Any]]) -> list[str]:
    reference = rows.get("ddp") or next(iter(rows.values()))
    last = reference["losses"][-1]
    return [
        f"{name}: last loss {row['losses'][-1]:.6f} differs from {last:.6f}"
        for name, row in rows.items()
        if abs(row["losses"][-1] - last) > LOSS_AGREEMENT * abs(last)
    ]


def main(argv: list[str] | None = None) -> int:
    """Runs the race and prints the report; returns the exit status."""
    args = parse_args(argv)
    names, skipped = _lineup(args)
    for name in skipped:
        print(f"skipped: {name} (deepspeed is not importable; install the bench group)")
    ctx = _context(with_deepspeed=any(n.startswith("deepspeed") for n in names))
    print(
        f"world {WORLD} gloo ranks, {args.threads} thread(s) each, {args.warmup} warm-up + "
        f"{args.steps} timed steps, {args.rounds} round(s), load average "
        f"{os.getloadavg()[0]:.1f}",
        flush=True,
    )
    reports: dict[str, list[list[dict[str, Any]]]] = {name: [] for name in names}
    with tempfile.TemporaryDirectory(prefix="zero-bench-") as folder:
        for round_index in range(args.rounds):
            order = names[round_index % len(names) :] + names[: round_index % len(names)]
            for name in order:
                print(f"running {name} (round {round_index + 1})", file=sys.stderr, flush=True)
                reports[name].append(_race_one(ctx, name, args, Path(folder)))
    rows = {name: _summarise(reports[name]) for name in names}
    print(f"model: {rows[names[0]]['params'] / 1e6:.2f}M parameters, fp32")
    _print_table(rows)
    for line in _verdicts(rows):
        print(line)
    disagreements = _losses_agree(rows)
    for line in disagreements:
        print(f"ERROR: {line}")
    return 1 if disagreements else 0


if __name__ == "__main__":
    sys.exit(main())
