"""AutoEP: tokens/s of forward + backward of a tiny Mixtral, DeepShard EP=2 vs HF under DDP.

    uv run --all-packages --group bench python tools/bench/autoep.py [--quick] [--steps 30]
        [--warmup 2] [--hidden 128] [--experts 8] [--top-k 2] [--no-deepspeed] [--json OUT]

Two CPU ranks over gloo train the same tiny ``MixtralForCausalLM`` (2 layers, hidden 128,
intermediate 256, 8 experts, top-2, vocabulary 512; ``--quick``: hidden 64, 4 steps) on
``batch × seq`` tokens per rank, in one run with the rows interleaved step by step (see
`_autoep_worker`): ``hf-ddp-loop`` (transformers' experts loop, ``experts_implementation=
"eager"``, every rank holding all experts, DDP's all-reduce), ``hf-ddp`` (the same with
transformers 5's default experts forward, a grouped matrix multiply) and ``deepshard-ep2``
(`parallelize_experts`, half the experts per rank, all-to-all dispatch). Reported: the median
step time, tokens/s over both ranks, the ratio ``deepshard-ep2 / hf-ddp-loop`` against the
target (>= 1.2x "the Hugging Face experts loop", MET or MISSED) and ``deepshard-ep2 / hf-ddp``,
the stronger grouped competitor, which the target does not name (reported without a verdict).

A reference row, ``hf-alone``, steps the HF model with no gradient exchange at all; the line
``hf-ddp / hf-alone`` under the table is what dropping every exchange would gain with HF's own
expert cost. Expert parallelism saves the expert all-reduce (its size grows with ``--experts``)
and pays three all-to-alls per layer forward and two backward; ``--experts 32`` is the
fine-grained shape (Qwen3-MoE, DeepSeek-V3), where the replicated experts' all-reduce is large.

A third row, ``deepspeed-autoep``, tries DeepSpeed v0.19.7's own AutoEP with the resolved
transformers: ``deepspeed.initialize`` with ``expert_parallel: {enabled, autoep_size: 2,
preset_model: mixtral}`` on the same gloo group, one forward + ``engine.backward`` first; when
that raises, the row prints ``skipped: deepspeed autoep (<error>)`` with the real error instead
of a number (``--no-deepspeed`` leaves it out).

``--json OUT`` also writes the report `run.py` collects (`_bench_json`): the step-time ratio
``deepshard-ep2`` / each competitor paired step by step (the rows alternate, so each timed step
of one row has a neighbour of the other; lower is better), every row's step times, and the
DeepSpeed row under ``missing`` with its reason when it did not run.

Exit status: 0 when both rows ran (a missed target included), 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("DEEPSHARD_ACCELERATOR", "cpu")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import _autoep_worker
import _bench_json

WORLD = 2
OURS = _autoep_worker.OURS
LOOP = _autoep_worker.LOOP_ROW
TARGET = 1.2
TIMEOUT_S = 900.0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line; ``--quick`` is the smoke size."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny model, 4 timed steps")
    parser.add_argument("--steps", type=int, default=30, help="timed steps per row")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per row first")
    parser.add_argument("--batch", type=int, default=4, help="sequences per rank")
    parser.add_argument("--seq", type=int, default=128, help="tokens per sequence")
    parser.add_argument("--hidden", type=int, default=128, help="hidden size (intermediate 2x)")
    parser.add_argument("--experts", type=int, default=8, help="experts per MoE layer (even)")
    parser.add_argument("--top-k", type=int, default=2, help="experts per token")
    parser.add_argument("--no-deepspeed", action="store_true", help="skip DeepSpeed's AutoEP row")
    parser.add_argument("--json", type=Path, help="also write the ratios as JSON (for run.py)")
    args = parser.parse_args(argv)
    if args.experts < 2 or args.experts % WORLD:
        parser.error(f"--experts {args.experts}: needs a multiple of {WORLD} (one half per rank)")
    if not 1 <= args.top_k <= args.experts:
        parser.error(f"--top-k {args.top_k}: needs 1 <= top-k <= --experts ({args.experts})")
    return args


def _spec(args: argparse.Namespace) -> dict[str, Any]:
    hidden = 64 if args.quick else args.hidden
    return {
        "vocab": 512,
        "hidden": hidden,
        "intermediate": 2 * hidden,
        "layers": 2,
        "experts": args.experts,
        "top_k": args.top_k,
        "batch": args.batch,
        "seq": 32 if args.quick else args.seq,
        "steps": 4 if args.quick else args.steps,
        "warmup": 1 if args.quick else args.warmup,
        "deepspeed": not args.no_deepspeed,
    }


def _run(spec: dict[str, Any], folder: Path) -> dict[str, Any] | None:
    ctx = multiprocessing.get_context("forkserver")
    out = folder / "rank0.json"
    jobs = [
        {"rank": r, "world": WORLD, "store": str(folder / "store"), "spec": spec, "out": str(out)}
        for r in range(WORLD)
    ]
    processes = [ctx.Process(target=_autoep_worker.run_rank, args=(job,)) for job in jobs]
    for p in processes:
        p.start()
    for p in processes:
        p.join(TIMEOUT_S)
    failed = [p for p in processes if p.exitcode != 0]
    for p in processes:
        if p.is_alive():
            p.kill()
    if failed or not out.exists():
        print(f"a rank failed (exit codes {[p.exitcode for p in processes]})", file=sys.stderr)
        return None
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def write_json(path: Path | None, result: dict[str, Any]) -> None:
    """Step time of ``deepshard-ep2`` over each competitor, paired step by step."""
    times: dict[str, list[float]] = result["times"]
    ours = times[OURS]
    rows = [
        _bench_json.ratio_row(OURS, theirs, "step time", _bench_json.paired_ratios(ours, series))
        for theirs, series in times.items()
        if theirs not in (OURS, _autoep_worker.REFERENCE_ROW)
    ]
    figures = {row: {"time_s": series, "peak_mib": None} for row, series in times.items()}
    missing = {}
    if _autoep_worker.DEEPSPEED_ROW not in times:
        missing[_autoep_worker.DEEPSPEED_ROW] = str(result["deepspeed_skipped"])
    _bench_json.write(path, "autoep", rows, figures, missing)


def main(argv: list[str] | None = None) -> int:
    """Run both rows once, interleaved, and print the table and the verdict."""
    args = parse_args(argv)
    spec = _spec(args)
    with tempfile.TemporaryDirectory() as tmp:
        result = _run(spec, Path(tmp))
    if result is None:
        return 1
    tokens = result["tokens_per_step"]
    print(
        f"tiny Mixtral, {spec['experts']} experts top-{spec['top_k']}, hidden {spec['hidden']}, "
        f"{tokens} tokens/step, 2 ranks"
    )
    print(f"{'row':<16}{'median step (ms)':>18}{'tokens/s':>12}")
    rate = {}
    for row in result["times"]:
        median = statistics.median(result["times"][row])
        rate[row] = tokens / median
        print(f"{row:<16}{median * 1e3:>18.2f}{rate[row]:>12.0f}")
    ratio = rate[OURS] / rate[LOOP]
    verdict = "MET" if ratio >= TARGET else "MISSED"
    print(f"{OURS} / {LOOP} tokens/s: {ratio:.2f}x (target >= {TARGET}x): {verdict}")
    grouped = rate[OURS] / rate["hf-ddp"]
    print(f"{OURS} / hf-ddp tokens/s: {grouped:.2f}x (transformers' grouped experts; no target)")
    ref = rate[_autoep_worker.REFERENCE_ROW] / rate["hf-ddp"]
    print(f"hf-ddp / hf-alone step time: {ref:.2f}x (what dropping every exchange would gain)")
    if _autoep_worker.DEEPSPEED_ROW in rate:
        ds_ratio = rate[OURS] / rate[_autoep_worker.DEEPSPEED_ROW]
        print(f"deepshard-ep2 / deepspeed-autoep tokens/s: {ds_ratio:.2f}x")
    else:
        print(f"skipped: deepspeed autoep ({result['deepspeed_skipped']})")
    write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    raise SystemExit(main())
