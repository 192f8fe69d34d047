"""Checkpoint save and load: DeepShard vs DeepSpeed, PyTorch DCP and the raw disk, 2 gloo ranks.

    uv run --all-packages --group bench python tools/bench/checkpoint.py [--quick] [--rounds 2]
        [--competitors raw,deepshard,deepspeed,dcp]

Every competitor saves and loads the training state of the same ~100.7M-parameter model (24
bias-free 2048x2048 linear layers; ``--quick``: 3 of 96x96) with AdamW state, on 2 CPU ranks
over gloo, in one run: ``raw`` (each rank's share of the 12 bytes per parameter written and
read sequentially in 64 MiB blocks: the disk's speed), ``deepshard``
(`deepshard.checkpoint.save` / ``load`` of ZeRO-style flat partitions, then an
``async_save``), ``deepspeed`` (ZeRO-2 ``save_checkpoint`` / ``load_checkpoint``) and ``dcp``
(``torch.distributed.checkpoint`` with FSDP2). `_checkpoint_worker` says exactly what each
does. Competitors run one after the other, ``--rounds`` times in rotated order (interleaved, so
a neighbour's load spike hits them alike); each figure is the best round (fastest time), and
files are evicted from the page cache before each load. Each round times every competitor's
load twice, each after an eviction, and keeps the faster (the ``load tries`` line lists them
all): on a virtual disk the first read after other I/O can be several times slower than the
next read of the same evicted files, which a single timed load per round charged to whichever
format it hit. Throughput is the bytes the
competitor put on disk over its time.

Targets, each MET or MISSED: DeepShard's save and load time <= 0.8x DeepSpeed's and DCP's;
DeepShard's save and load throughput >= 0.7x the raw disk's; async save blocks <= 0.1x of a
sync save. The table says which saves fsync (DeepSpeed's does not); ``deepspeed+fsync`` is its
save followed by an fsync of what it wrote, the durable save on equal terms (no target). Exit
status 0 when every competitor ran (missed targets included), 1 otherwise.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import multiprocessing
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("DEEPSHARD_ACCELERATOR", "cpu")

import _bench_json
import _checkpoint_worker  # (after the environment above: it must be set before torch loads)
import _ranks

WORLD = 2
RANK_TIMEOUT_S = 1200.0
NAMES = ("raw", "deepshard", "deepspeed", "dcp")
# (ours, theirs, measure, target, kind): time ratios must be <= target, throughput >= target.
TARGETS = (
    ("deepshard", "deepspeed", "save_s", 0.8, "time"),
    ("deepshard", "deepspeed", "load_s", 0.8, "time"),
    ("deepshard", "dcp", "save_s", 0.8, "time"),
    ("deepshard", "dcp", "load_s", 0.8, "time"),
    ("deepshard", "raw", "save_s", 0.7, "throughput"),
    ("deepshard", "raw", "load_s", 0.7, "throughput"),
)
ASYNC_TARGET = 0.1


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line; ``--quick`` is the smoke size (a tiny model, one round)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny model, 1 round")
    parser.add_argument("--rounds", type=int, help="line-up repetitions (default 2; quick 1)")
    parser.add_argument(
        "--competitors",
        type=lambda text: [n.strip() for n in text.split(",") if n.strip()],
        default=list(NAMES),
        help=f"a subset of {','.join(NAMES)}",
    )
    parser.add_argument("--json", type=Path, help="also write the ratios as JSON (for run.py)")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.competitors) - set(NAMES))
    if unknown:
        parser.error(f"--competitors: unknown {unknown}; choose from {','.join(NAMES)}")
    if args.rounds is None:
        args.rounds = 1 if args.quick else 2
    if args.rounds < 1:
        parser.error("--rounds must be >= 1")
    return args


def _race_one(ctx: Any, name: str, quick: bool, folder: Path) -> dict[str, Any]:
    """Runs one competitor on ``WORLD`` ranks in a fresh folder; returns rank 0's report."""
    work = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=folder))
    port = _ranks.free_port()
    jobs = [
        _checkpoint_worker.RankJob(
            name, rank, WORLD, port, quick, str(work / "ckpt"), str(work / f"report-{rank}.json")
        )
        for rank in range(WORLD)
    ]
    (work / "ckpt").mkdir()
    exitcodes = _ranks.run_ranks(ctx, _checkpoint_worker.run_rank, jobs, RANK_TIMEOUT_S)
    _ranks.raise_with_logs(name, jobs, exitcodes, tail=3000)
    report: dict[str, Any] = json.loads(Path(jobs[0].out).read_text())
    for path in sorted(work.rglob("*"), reverse=True):  # free the disk before the next one
        path.unlink() if path.is_file() else path.rmdir()
    return report


def best(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """The fastest round of each timed figure; the other fields from the last round."""
    row = dict(rounds[-1])
    for key in (
        "save_s",
        "load_s",
        "load_unchecked_s",
        "async_blocking_s",
        "async_total_s",
        "async_steady_blocking_s",
        "async_prepared_blocking_s",
        "save_fsync_s",
    ):
        if key in row:
            row[key] = min(r[key] for r in rounds)
    return row


def table(rows: dict[str, dict[str, Any]]) -> list[str]:
    """The figures, one row per competitor."""
    lines = [
        "| competitor | save fsyncs | save s | save GB/s | load s | load GB/s | on disk MB |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, row in with_durable(rows).items():
        gb = row["bytes"] / 1e9
        lines.append(
            f"| {name} | {'yes' if row['fsync'] else 'no'} | {row['save_s']:.6f} "
            f"| {gb / row['save_s']:.3f} | {row['load_s']:.6f} | {gb / row['load_s']:.3f} "
            f"| {row['bytes'] / 1e6:.3f} |"
        )
    return lines


def load_tries(reports: dict[str, list[dict[str, Any]]]) -> list[str]:
    """Every timed load of every round, per competitor (``load_s`` is the fastest of them)."""
    cells = []
    for name, rounds in reports.items():
        times = [t for r in rounds for t in r["load_tries_s"]]
        cells.append(f"{name} {' / '.join(f'{t:.3f}' for t in times)}")
    return [f"load tries, s (each after an eviction; the fastest counts): {'; '.join(cells)}"]


def with_durable(rows: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """``rows`` plus ``deepspeed+fsync``: DeepSpeed's save followed by an fsync of its files.

    DeepSpeed's ``torch.save`` returns before its bytes reach the disk; the other rows fsync
    (``fsync``), so this row compares the durable saves on equal terms.
    """
    out = dict(rows)
    if "deepspeed" in rows and "save_fsync_s" in rows["deepspeed"]:
        durable = dict(rows["deepspeed"], save_s=rows["deepspeed"]["save_fsync_s"], fsync=True)
        out["deepspeed+fsync"] = durable
    return out


def _verdict(ratio: float, target: float, kind: str) -> str:
    met = ratio <= target if kind == "time" else ratio >= target
    sign = "<=" if kind == "time" else ">="
    return f"{ratio:.3f} (target {sign} {target}): {'MET' if met else 'MISSED'}"


def verdicts(rows: dict[str, dict[str, Any]]) -> list[str]:
    """Every target ratio whose two rows ran, with its verdict."""
    lines = []
    for ours, theirs, measure, target, kind in TARGETS:
        if ours not in rows or theirs not in rows:
            continue
        what = measure.removesuffix("_s")
        if kind == "time":
            ratio = rows[ours][measure] / rows[theirs][measure]
            label = f"{ours} / {theirs}: {what} time ratio"
        else:
            mine = rows[ours]["bytes"] / rows[ours][measure]
            ratio = mine / (rows[theirs]["bytes"] / rows[theirs][measure])
            label = f"{ours} / {theirs}: {what} throughput ratio"
        lines.append(f"{label} {_verdict(ratio, target, kind)}")
    durable = with_durable(rows)
    if "deepshard" in rows and "deepspeed+fsync" in durable:
        ratio = rows["deepshard"]["save_s"] / durable["deepspeed+fsync"]["save_s"]
        lines.append(
            f"deepshard / deepspeed+fsync: save time ratio {ratio:.3f} (both durable; no target, "
            "the target above compares with DeepSpeed's save that does not fsync)"
        )
    if "deepshard" in rows:
        row = rows["deepshard"]
        lines.append(
            f"deepshard load without checksums: {row['load_unchecked_s']:.4f} s (no target; "
            f"checked: {row['load_s']:.4f} s)"
        )
        ratio = row["async_blocking_s"] / row["save_s"]
        lines.append(
            f"deepshard async / sync: save blocking ratio {_verdict(ratio, ASYNC_TARGET, 'time')}"
            f" (blocked {row['async_blocking_s']:.3f} s, finished in {row['async_total_s']:.3f} s)"
        )
        if "async_steady_blocking_s" in row:
            ratio = row["async_steady_blocking_s"] / row["save_s"]
            lines.append(
                "deepshard later async saves (after=, buffers reused) / sync: blocking ratio "
                f"{_verdict(ratio, ASYNC_TARGET, 'time')} "
                f"(blocked {row['async_steady_blocking_s']:.3f} s)"
            )
        if "async_prepared_blocking_s" in row:
            ratio = row["async_prepared_blocking_s"] / row["save_s"]
            lines.append(
                "deepshard first async save after prepare_async_save / sync: blocking ratio "
                f"{_verdict(ratio, ASYNC_TARGET, 'time')} "
                f"(blocked {row['async_prepared_blocking_s']:.3f} s)"
            )
    return lines


def write_json(
    path: Path | None, reports: dict[str, list[dict[str, Any]]], missing: dict[str, str]
) -> None:
    """Each target's time ratio per round (save and load; lower is better) and every row's own
    save times, in `_bench_json`'s shape for `run.py`."""
    rows = [
        _bench_json.ratio_row(
            ours,
            theirs,
            f"{measure.removesuffix('_s')} time",
            _bench_json.paired_ratios(
                [r[measure] for r in reports[ours]], [r[measure] for r in reports[theirs]]
            ),
        )
        for ours, theirs, measure, _, _ in TARGETS
        if reports.get(ours) and reports.get(theirs)
    ]
    figures = {
        name: {"time_s": [r["save_s"] for r in rounds], "peak_mib": None, "measure": "save"}
        for name, rounds in reports.items()
        if rounds
    }
    _bench_json.write(path, "checkpoint", rows, figures, missing)


def main(argv: list[str] | None = None) -> int:
    """Runs the race and prints the report; returns the exit status."""
    args = parse_args(argv)
    names = list(args.competitors)
    missing: dict[str, str] = {}
    if "deepspeed" in names and importlib.util.find_spec("deepspeed") is None:
        names.remove("deepspeed")
        missing["deepspeed"] = "deepspeed is not importable; install the bench group"
        print(f"skipped: deepspeed ({missing['deepspeed']})")
    ctx = multiprocessing.get_context("forkserver")
    preload = ["torch", "torch.distributed", "torch.distributed.checkpoint", "_checkpoint_worker"]
    preload += ["deepshard.checkpoint._save", "deepshard.checkpoint._load"]
    ctx.set_forkserver_preload(preload + (["deepspeed"] if "deepspeed" in names else []))
    shape = _checkpoint_worker.QUICK if args.quick else _checkpoint_worker.FULL
    print(
        f"model: {shape.params / 1e6:.2f}M parameters (fp32 weights + AdamW moments), world "
        f"{WORLD} gloo ranks, {args.rounds} round(s), load average {os.getloadavg()[0]:.1f}",
        flush=True,
    )
    reports: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    with tempfile.TemporaryDirectory(prefix="checkpoint-bench-") as folder:
        for round_index in range(args.rounds):
            shift = round_index % len(names)
            for name in names[shift:] + names[:shift]:
                print(f"running {name} (round {round_index + 1})", file=sys.stderr, flush=True)
                try:
                    reports[name].append(_race_one(ctx, name, args.quick, Path(folder)))
                except RuntimeError as error:
                    print(f"ERROR: {error}")
                    return 1
    rows = {name: best(reports[name]) for name in names}
    for line in table(rows) + load_tries(reports) + verdicts(rows):
        print(line)
    write_json(args.json, reports, missing)
    if "deepshard" in rows and not rows["deepshard"]["roundtrip_equal"]:
        print("ERROR: deepshard's loaded state differs from what it saved")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
