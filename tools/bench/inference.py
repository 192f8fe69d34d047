"""Generation throughput: DeepShard continuous batching vs HF static batches vs DeepSpeed's rollout.

    uv run --all-packages --group bench python tools/bench/inference.py [--quick]
        [--batch 4] [--rounds 3] [--json OUT]

One process, one thread, CPU, fp32: a seeded tiny ``LlamaForCausalLM`` built from a config
(`_inference_worker.FULL`: hidden 256, 4 layers, 8 query / 4 KV heads, vocabulary 2048) serves
32 requests that all arrive at time zero, with seeded mixed prompt lengths (4-96 tokens) and
mixed budgets (8-96 new tokens), greedy, no EOS. The engines (`_inference_worker`):

* ``deepshard-cb``: `deepshard.inference._loop.generate_requests` with ``max_batch_size`` B,
  under ``torch.inference_mode()`` as ``InferenceEngine.generate`` runs it (HF's ``generate``
  runs under its own ``torch.no_grad()``);
* ``hf-static``: Hugging Face ``generate`` on static left-padded batches of B requests in
  arrival order, each batch decoding until its longest budget is spent;
* ``deepspeed-cb``: DeepSpeed 0.19.7's rollout continuous-batching prototype
  (``HybridEngineRollout`` with ``continuous_batch_size`` B) where it runs; on transformers 5
  it refuses, and the report says ``skipped: deepspeed (<the error it raised>)``;
* ``deepspeed-static``: the same rollout's default path (the model's ``generate`` on the same
  static batches, EOS ignored), which does run here.

Useful tokens are each request's own budget (a static batch's extra steps for its shorter
requests are not counted), the same number for every engine; tokens/s is useful tokens over
the wall time of the whole pass. Time to first token is per request, from the start of the
pass to the end of the forward that prefilled it (mean and median over the requests). Every
engine's tokens must equal ``hf-static``'s, request for request; a mismatch is an ``ERROR``
(a race won with wrong answers counts for nothing).

``--rounds`` passes of the line-up run in rotated order after one untimed warm-up pass per
engine; the table shows each engine's fastest pass, the ratios compare fastest passes.
Target: ``deepshard-cb`` tokens/s >= 1.5x ``hf-static``'s. The JSON for `run.py` holds, per
paired round, the lower-is-better ratios: wall time per useful token (the inverse of the
tokens/s ratio, so the target is <= 0.667) and mean time to first token.

Exit status: 0 when ``deepshard-cb`` and ``hf-static`` ran and every engine that ran agreed
with ``hf-static`` (a missed target included); 1 otherwise.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import _bench_json
import _inference_worker as worker

OURS = "deepshard-cb"
REFERENCE = "hf-static"
TARGET = 1.5
"""``deepshard-cb`` tokens/s over ``hf-static``'s must reach this (issue 18)."""
Runner = Callable[[list[worker.Request]], worker.RunResult]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line; ``--quick`` is the smoke size (a smaller Llama, short requests)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny shapes, 1 round")
    parser.add_argument("--batch", type=int, default=4, help="B: max_batch_size / static batch")
    parser.add_argument("--rounds", type=int, help="timed passes per engine (default 3)")
    parser.add_argument("--json", type=Path, help="also write the ratios as JSON (for run.py)")
    args = parser.parse_args(argv)
    if args.rounds is None:
        args.rounds = 1 if args.quick else 3
    if args.batch < 1 or args.rounds < 1:
        parser.error("--batch and --rounds must be >= 1")
    return args


def _reason(error: BaseException) -> str:
    text = f"{type(error).__name__}: {error}".splitlines()[0]
    return text[:300]


def build_runners(model: Any, batch: int) -> tuple[dict[str, Runner], dict[str, str]]:
    """Every engine that can run here, and why each of the others cannot."""
    runners: dict[str, Runner] = {
        REFERENCE: lambda reqs: worker.run_hf_static(model, reqs, batch),
    }
    missing: dict[str, str] = {}
    try:
        importlib.import_module("deepshard.inference._loop")
    except ImportError as error:
        missing[OURS] = f"deepshard.inference._loop is not importable ({_reason(error)})"
    else:
        runners[OURS] = lambda reqs: worker.run_deepshard(model, reqs, batch)
    if importlib.util.find_spec("deepspeed") is None:
        missing["deepspeed"] = "not installed (it comes from the bench dependency group)"
        return runners, missing
    try:
        engine = worker.deepspeed_engine(model)
    except Exception as error:  # any failure of DeepSpeed's is reported, not fatal
        missing["deepspeed"] = f"deepspeed.initialize: {_reason(error)}"
        return runners, missing
    runners["deepspeed-cb"] = lambda reqs: worker.run_deepspeed(engine, reqs, batch, True)
    runners["deepspeed-static"] = lambda reqs: worker.run_deepspeed(engine, reqs, batch, False)
    return runners, missing


def warm_up(
    runners: dict[str, Runner], requests: list[worker.Request], missing: dict[str, str]
) -> None:
    """One untimed pass per engine; an engine that raises is dropped and its error reported."""
    for name in list(runners):
        print(f"warming up {name}", file=sys.stderr, flush=True)
        try:
            runners[name](requests)
        except Exception as error:  # a competitor's refusal is a finding
            del runners[name]
            label = "deepspeed" if name.startswith("deepspeed") else name
            prefix = "continuous batching: " if name == "deepspeed-cb" else ""
            missing[label if label not in missing else name] = prefix + _reason(error)


def race(
    runners: dict[str, Runner], requests: list[worker.Request], rounds: int
) -> dict[str, list[worker.RunResult]]:
    """``rounds`` timed passes of every engine, the line-up rotated each round."""
    names = list(runners)
    results: dict[str, list[worker.RunResult]] = {name: [] for name in names}
    for index in range(rounds):
        shift = index % len(names)
        for name in names[shift:] + names[:shift]:
            start = time.monotonic()
            results[name].append(runners[name](requests))
            print(f"{name} round {index + 1}: {time.monotonic() - start:.2f} s", file=sys.stderr)
    return results


def _best(results: list[worker.RunResult]) -> worker.RunResult:
    return min(results, key=lambda r: r.wall_s)


def table(results: dict[str, list[worker.RunResult]]) -> list[str]:
    """One row per engine, its fastest pass."""
    lines = [
        "| engine | useful tokens | wall s | tokens/s | ttft mean s | ttft p50 s | forwards |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, runs in results.items():
        r = _best(runs)
        lines.append(
            f"| {name} | {r.useful_tokens} | {r.wall_s:.3f} | {r.tokens_per_s:.1f} "
            f"| {r.ttft_mean_s:.4f} | {r.ttft_p50_s:.4f} | {r.forwards} |"
        )
    return lines


def verdicts(results: dict[str, list[worker.RunResult]]) -> list[str]:
    """``deepshard-cb`` / every other engine: tokens/s (higher is better) and time to first
    token (lower is better); only the tokens/s ratio to ``hf-static`` has a target."""
    if OURS not in results:
        return []
    ours = _best(results[OURS])
    lines = []
    for theirs in (name for name in results if name != OURS):
        other = _best(results[theirs])
        ratio = ours.tokens_per_s / other.tokens_per_s
        verdict = "(no target)"
        if theirs == REFERENCE:
            met = ratio >= TARGET
            verdict = f"(target >= {TARGET}): " + (
                "MET" if met else f"MISSED by {TARGET - ratio:.3f}"
            )
        lines.append(f"{OURS} / {theirs}: tokens/s ratio {ratio:.3f} {verdict}")
        for what, mine, their in (
            ("mean", ours.ttft_mean_s, other.ttft_mean_s),
            ("p50", ours.ttft_p50_s, other.ttft_p50_s),
        ):
            lines.append(
                f"{OURS} / {theirs}: time to first token {what} ratio {mine / their:.3f} "
                "(lower is better, no target)"
            )
    return lines


def agreement(results: dict[str, list[worker.RunResult]]) -> list[str]:
    """Every pass of every engine against ``hf-static``'s first pass, request for request."""
    reference = results[REFERENCE][0]
    errors = []
    for name, runs in results.items():
        for index, run in enumerate(runs):
            for bad in worker.mismatches(run, reference)[:3]:
                errors.append(f"{name} round {index + 1} differs from {REFERENCE}: {bad}")
            if run.useful_tokens != reference.useful_tokens:
                errors.append(f"{name} round {index + 1}: {run.useful_tokens} useful tokens")
    return errors


def write_json(
    path: Path | None, results: dict[str, list[worker.RunResult]], missing: dict[str, str]
) -> None:
    """Per paired round: wall per useful token and mean time to first token, ours / theirs."""
    rows = []
    if OURS in results:
        ours = results[OURS]
        for theirs, runs in results.items():
            if theirs == OURS:
                continue
            for measure, key in (
                ("time per useful token", "wall_s"),
                ("time to first token (mean)", "ttft_mean_s"),
            ):
                values = _bench_json.paired_ratios(
                    [getattr(r, key) for r in ours], [getattr(r, key) for r in runs]
                )
                rows.append(_bench_json.ratio_row(OURS, theirs, measure, values))
    figures = {
        name: {"time_s": [r.wall_s for r in runs], "peak_mib": None, "measure": "pass"}
        for name, runs in results.items()
    }
    _bench_json.write(path, "inference", rows, figures, missing)


def main(argv: list[str] | None = None) -> int:
    """Builds the model and requests, races the engines and prints the report."""
    args = parse_args(argv)
    import torch

    torch.set_num_threads(1)
    shape = worker.QUICK if args.quick else worker.FULL
    model = worker.build_model(shape)
    requests = worker.build_requests(shape)
    params = sum(p.numel() for p in model.parameters())
    print(
        f"{shape.describe()}; {params / 1e6:.2f}M parameters, fp32, 1 thread; "
        f"B={args.batch}, greedy, no EOS; 1 warm-up + {args.rounds} timed pass(es) "
        f"per engine; load average {os.getloadavg()[0]:.1f}",
        flush=True,
    )
    runners, missing = build_runners(model, args.batch)
    warm_up(runners, requests[: 2 * args.batch], missing)
    results = race(runners, requests, args.rounds) if REFERENCE in runners else {}
    print(f"load average at the end {os.getloadavg()[0]:.1f}")
    for line in table(results) + verdicts(results):
        print(line)
    for name, reason in missing.items():
        print(f"skipped: {name} ({reason})")
    errors = agreement(results) if REFERENCE in results else [f"{REFERENCE} did not run"]
    if not errors:
        print(f"outputs: every engine's tokens equal {REFERENCE}'s on all {len(requests)} requests")
    for line in errors:
        print(f"ERROR: {line}")
    write_json(args.json, results, missing)
    return 1 if errors or OURS not in results else 0


if __name__ == "__main__":
    sys.exit(main())
