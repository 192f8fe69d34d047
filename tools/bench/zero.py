"""ZeRO training step: DeepShard stages 0-3 vs DDP, FSDP2 and DeepSpeed ZeRO 0-3, 2 gloo ranks.

    uv run --all-packages --group bench python tools/bench/zero.py [--quick] [--stages 0-2]
        [--steps 4] [--warmup 2] [--rounds 3] [--threads 1] [--dtype fp32]
        [--competitors deepshard-0,ddp]

Every competitor trains the same ~10.5M-parameter GPT-style model (`_zero_model.FULL`) on 2 CPU
ranks over gloo, from the same initial weights, on the same token batches, with AdamW (lr 1e-3,
weight decay 0.01) and gradient clipping at 1.0 (`_zero_lineup` lists them):

* stages 0-2: ``ddp`` (``DistributedDataParallel``, ``clip_grad_norm_``, ``torch.optim.AdamW``),
  ``deepspeed-K`` (DeepSpeed 0.19.7, ``DS_ACCELERATOR=cpu``, ``"torch_adam": true``) and
  ``deepshard-K`` (``deepshard.engine.initialize`` with the same config; stages 1-2 set
  ``overlap_comm: true`` for both engines, as DDP overlaps its all-reduce with backward);
* stage 3: ``fsdp2`` (``fully_shard`` per block and the root, `MixedPrecisionPolicy` of the
  dtype) and ``fsdp2-offload-all`` (plus ``CPUOffloadPolicy``); ``deepspeed-3`` and
  ``deepshard-3``, and their ``-offload-opt`` (``offload_optimizer: cpu``) and ``-offload-all``
  (``offload_param`` too) rows, which step with each engine's own CPU Adam.

Each competitor runs as a pair of rank processes forked from a server that imported torch,
DeepSpeed and DeepShard once, so import time is not raced. A rank trains ``warmup`` untimed and
``steps`` timed steps; a step's time is rank 0's wall time for forward, backward and optimizer
step. The table shows the fastest and the median step over all timed steps of ``--rounds``
repetitions of the line-up (in rotated order, so the rounds interleave). The ratios the targets
are about use the fastest step, the one least disturbed by other load on a shared machine (as
``timeit`` does; the median moves with the neighbours' load by tens of percent between runs);
the median ratio is printed beside it. Targets (`_zero_lineup.PAIRINGS`), each MET or MISSED:
DeepShard stage K <= 1.0x DeepSpeed stage K and stages 0-2 <= 1.1x DDP; stage 3 <= 0.95x FSDP2
and <= 0.9x DeepSpeed ZeRO-3; optimizer offload <= 0.9x DeepSpeed's; peak memory per rank <=
FSDP2's (plain and offload-all); under ``--dtype bf16`` the stage-2 ``-bf16-masters`` rows
(``bf16_master_weights_and_grads`` + ``bf16_optimizer_states``) <= 1.0x DeepSpeed's.

Memory per rank is the **peak resident-set growth** of the rank process (Linux ``VmHWM`` after
resetting it through ``/proc/self/clear_refs``, minus ``VmRSS`` at start), the larger of the two
ranks: what the process really touched for model, gradients, optimizer state, communication
buffers and activations, allocator included. On a CPU-only machine "offloaded" state is host
memory like everything else, so offload cannot lower this figure here; it measures the offload
code paths' cost. DeepShard's rows also list its own tensor-byte count (parameters, gradients,
fp32 masters, optimizer state) from ``engine.memory_bytes()``, on lines of their own. As a
sanity check every competitor's last loss must agree with DDP's (else FSDP2's) to 1e-3 relative
(2e-2 in bf16).

Exit status: 0 when every competitor ran (missed targets included); 1 when one failed or the
losses disagree; 2 when DeepShard refused a row's config (the row and every ratio needing it
say ``REFUSED`` with the error's first line; no number stands in for it).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import multiprocessing
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("DEEPSHARD_ACCELERATOR", "cpu")

import _ranks
import _zero_report  # (after the environment above: it must be set before torch loads)
import _zero_worker
from _zero_lineup import BY_NAME, DTYPES, parse_stages, select

WORLD = 2
RANK_TIMEOUT_S = 600.0
DEFAULTS = {"steps": 4, "rounds": 3, "warmup": 2}
QUICK_DEFAULTS = {"steps": 2, "rounds": 1, "warmup": 1}
DEFAULT_STAGES = "0-2"


def _names(text: str) -> list[str]:
    return [n.strip() for n in text.split(",") if n.strip()]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line; ``--quick`` is the smoke size: a tiny model, 1 + 2 steps."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny model, 1 warm-up + 2 steps")
    parser.add_argument("--steps", type=int, help="timed steps per round (default 4)")
    parser.add_argument("--warmup", type=int, help="untimed steps first (default 2)")
    parser.add_argument("--rounds", type=int, help="line-up repetitions (default 3)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument(
        "--stages",
        default=DEFAULT_STAGES,
        help=f"stages to race: 0-2 (with DDP), 3 (with FSDP2), all (default {DEFAULT_STAGES})",
    )
    parser.add_argument("--dtype", choices=DTYPES, default="fp32", help="training dtype")
    parser.add_argument(
        "--competitors", type=_names, help=f"a subset of the stages' rows: {','.join(BY_NAME)}"
    )
    parser.add_argument("--json", type=Path, help="also write the ratios as JSON (for run.py)")
    args = parser.parse_args(argv)
    try:
        args.lineup = [
            c.name for c in select(parse_stages(args.stages), args.competitors, args.dtype)
        ]
    except ValueError as error:
        parser.error(str(error))
    for key, value in (QUICK_DEFAULTS if args.quick else DEFAULTS).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.steps < 1 or args.rounds < 1 or args.warmup < 0 or args.threads < 1:
        parser.error("--steps, --rounds and --threads must be >= 1, --warmup >= 0")
    return args


def _context(with_deepspeed: bool) -> Any:
    ctx = multiprocessing.get_context("forkserver")
    # What competitors import lazily is preloaded, so no row's RSS growth counts imports:
    # `fully_shard` imports torch._dynamo (~120 MiB RSS) unless DeepSpeed already has.
    preload = ["torch", "torch.distributed", "torch.distributed.fsdp", "torch._dynamo"]
    preload += ["_zero_model", "_zero_worker", "deepshard.engine"]
    if with_deepspeed:
        preload.append("deepspeed")
    ctx.set_forkserver_preload(preload)
    return ctx


def _race_one(ctx: Any, name: str, args: argparse.Namespace, folder: Path) -> list[dict[str, Any]]:
    """Runs one competitor on ``WORLD`` ranks; returns each rank's report."""
    port = _ranks.free_port()
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
            args.dtype,
        )
        for rank in range(WORLD)
    ]
    exitcodes = _ranks.run_ranks(ctx, _zero_worker.run_rank, jobs, RANK_TIMEOUT_S)
    _ranks.raise_with_logs(name, jobs, exitcodes)
    return [json.loads(Path(job.out).read_text()) for job in jobs]


def _lineup(args: argparse.Namespace) -> tuple[list[str], list[str]]:
    names: list[str] = args.lineup
    if importlib.util.find_spec("deepspeed") is not None:
        return names, []
    skipped = [n for n in names if n.startswith("deepspeed")]
    return [n for n in names if n not in skipped], skipped


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
                if reports[name] and "refused" in reports[name][-1][0]:
                    continue  # a refusal does not change between rounds
                print(f"running {name} (round {round_index + 1})", file=sys.stderr, flush=True)
                start = time.monotonic()
                reports[name].append(_race_one(ctx, name, args, Path(folder)))
                print(f"  {time.monotonic() - start:.1f} s", file=sys.stderr, flush=True)
    rows = {name: _zero_report.summarise(reports[name]) for name in names}
    measured = [row for row in rows.values() if "params" in row]
    if measured:
        print(f"model: {measured[0]['params'] / 1e6:.2f}M parameters, {args.dtype}")
    for line in _zero_report.table(rows) + _zero_report.verdicts(rows):
        print(line)
    missing = {n: "deepspeed is not importable; install the bench group" for n in skipped}
    _zero_report.write_json(args.json, reports, rows, missing)
    disagreements = _zero_report.loss_disagreements(rows, args.dtype)
    for line in disagreements:
        print(f"ERROR: {line}")
    return _zero_report.exit_status(rows, disagreements)


if __name__ == "__main__":
    sys.exit(main())
