"""Profiling overhead: DeepShard's FLOPs profiler vs DeepSpeed's and torch's ``FlopCounterMode``.

One training step of a tiny Hugging Face Llama (forward with the loss, then backward; no
optimizer, so only what a profiler can slow down is timed) is run plain and under each
profiler, which stays on for the whole step:

* ``deepshard``: ``FlopsProfiler(model, count_backward=True)`` (counts forward and backward),
  the default ``count_mode="auto"``: the step runs with module hooks only and the FLOPs are
  counted when read, from a fake-tensor replay of the recorded calls;
* ``deepshard-fwd``: the same counting the forward only (what DeepSpeed counts);
* ``deepshard-eager`` / ``deepshard-fwd-eager``: the same with ``count_mode="eager"`` (a
  dispatch mode counts every aten operator while the step runs);
* ``deepspeed``: ``deepspeed.profiling.flops_profiler.FlopsProfiler`` (patches
  ``torch.nn.functional`` and tensor methods, hooks every module);
* ``flop_counter``: ``torch.utils.flop_counter.FlopCounterMode`` (a dispatch mode, no latency).

Each round runs every variant once, in an order rotated round by round, so a slow phase of a
shared machine hits all alike: ``--warmup`` steps under the variant's profiler (not timed), then
``--steps`` timed steps, whose median is the variant's time in that round. A variant's overhead
is its median step time over plain's. The comparison with DeepSpeed is paired: per round, the
variant's time over DeepSpeed's in the same round, the median over the rounds reported with
its range. The target, DeepShard's overhead no worse than DeepSpeed's (a ratio <= 1), is
decided like for like on ``deepshard-fwd`` (DeepSpeed counts the forward only); the ratio of
``deepshard`` (forward and backward, more work) is reported beside it. The bench also prints
each profiler's forward FLOPs of the Llama with the time the first read of them took (for
the replaying variants, the replay: off the timed step, paid once per distinct call), and
checks the LeNet-5 acceptance numbers against DeepSpeed's own ``get_model_profile``; it exits
1 when the target is missed or LeNet differs.

Run from the repository root (DeepSpeed comes from the ``bench`` group)::

    uv run --all-packages --group bench python tools/bench/profiler.py
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import _bench_json
import torch
import torch.nn.functional as F
from torch import nn

VARIANTS = (
    "plain",
    "deepshard",
    "deepshard-fwd",
    "deepshard-eager",
    "deepshard-fwd-eager",
    "deepspeed",
    "flop_counter",
)


def _llama(hidden: int, layers: int, device: torch.device) -> nn.Module:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=max(hidden // 32, 1),
        num_key_value_heads=max(hidden // 64, 1),
        vocab_size=512,
        max_position_embeddings=512,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to(device)


@contextlib.contextmanager
def _profiled(variant: str, model: nn.Module) -> Iterator[Callable[[], int]]:
    """Keep ``variant``'s profiler on inside the block; yields a reader of its forward FLOPs."""
    if variant == "plain":
        yield lambda: 0
    elif variant.startswith("deepshard"):
        from deepshard.profiler import FlopsProfiler

        ours = FlopsProfiler(
            model,
            count_backward="fwd" not in variant,
            count_mode="eager" if variant.endswith("eager") else "auto",
        )
        ours.start_profile()
        try:
            yield lambda: int(ours.get_total_flops())
        finally:
            ours.end_profile()
    elif variant == "deepspeed":
        from deepspeed.profiling.flops_profiler import FlopsProfiler as DeepSpeedProfiler

        theirs = DeepSpeedProfiler(model)
        theirs.start_profile()
        try:
            yield lambda: int(theirs.get_total_flops())
        finally:
            theirs.end_profile()
    else:
        from torch.utils.flop_counter import FlopCounterMode

        with FlopCounterMode(display=False) as counter:
            yield lambda: int(counter.get_total_flops())


def _step(model: nn.Module, ids: torch.Tensor, sync: Callable[[], None]) -> float:
    sync()
    start = time.perf_counter()
    model(input_ids=ids, labels=ids).loss.backward()
    sync()
    return time.perf_counter() - start


def _race(args: argparse.Namespace, device: torch.device) -> list[dict[str, float]]:
    """Per round, each variant's median step time (seconds)."""
    model = _llama(args.hidden, args.layers, device)
    ids = torch.randint(0, 512, (args.batch, args.seq), device=device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    rounds: list[dict[str, float]] = []
    for round_index in range(args.rounds):
        shift = round_index % len(args.variants)
        medians: dict[str, float] = {}
        for variant in args.variants[shift:] + args.variants[:shift]:
            with _profiled(variant, model):
                for _ in range(args.warmup):
                    _step(model, ids, sync)
                samples = [_step(model, ids, sync) for _ in range(args.steps)]
            medians[variant] = statistics.median(samples)
            model.zero_grad(set_to_none=True)
        rounds.append(medians)
    return rounds


def _paired_ratio(rounds: list[dict[str, float]], variant: str) -> tuple[float, float, float]:
    """(median, min, max) over the rounds of ``variant``'s time over DeepSpeed's."""
    ratios = [r[variant] / r["deepspeed"] for r in rounds]
    return statistics.median(ratios), min(ratios), max(ratios)


def _report_times(rounds: list[dict[str, float]]) -> bool:
    """Print the step times, overheads and ratios; whether the target was met."""
    plain = statistics.median(r["plain"] for r in rounds) if "plain" in rounds[0] else None
    print(f"{'variant':<20}{'median step ms':>16}{'overhead':>10}")
    for variant in rounds[0]:
        median = statistics.median(r[variant] for r in rounds)
        overhead = f"{median / plain:>9.2f}x" if plain else f"{'-':>10}"
        print(f"{variant:<20}{1e3 * median:>16.2f}{overhead}")
    if "deepspeed" not in rounds[0] or "deepshard-fwd" not in rounds[0]:
        print("target not decided: it needs the deepshard-fwd and deepspeed variants")
        return False
    met = False
    for variant in ("deepshard-fwd", "deepshard", "deepshard-fwd-eager", "deepshard-eager"):
        if variant in rounds[0]:
            median, low, high = _paired_ratio(rounds, variant)
            what = (
                "like for like, the target"
                if variant == "deepshard-fwd"
                else ("fwd+bwd counted" if "fwd" not in variant else "forward counted")
            )
            print(f"{variant}/deepspeed step time: {median:.3f} (rounds {low:.3f}-{high:.3f}; "
                  f"{what})")  # fmt: skip
            met = met or (variant == "deepshard-fwd" and median <= 1.0)
    verdict = "MET" if met else "MISSED"
    print(f"target (deepshard-fwd overhead <= deepspeed's): {verdict}")
    return met


def _forward_flops(args: argparse.Namespace, device: torch.device) -> dict[str, tuple[int, float]]:
    """Per variant, the forward FLOPs of one no-grad forward and the seconds the read took."""
    model = _llama(args.hidden, args.layers, device)
    ids = torch.randint(0, 512, (args.batch, args.seq), device=device)
    counts = {}
    for variant in args.variants:
        if variant == "plain":
            continue
        with torch.no_grad(), _profiled(variant, model) as read:
            model(input_ids=ids, labels=ids)
            start = time.perf_counter()
            flops = read()
            counts[variant] = (flops, time.perf_counter() - start)
    return counts


class _LeNet5(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.feature_extractor = nn.Sequential(
            nn.Conv2d(1, 6, 5), nn.Tanh(), nn.AvgPool2d(2),
            nn.Conv2d(6, 16, 5), nn.Tanh(), nn.AvgPool2d(2),
            nn.Conv2d(16, 120, 5), nn.Tanh(),
        )  # fmt: skip
        self.classifier = nn.Sequential(nn.Linear(120, 84), nn.Tanh(), nn.Linear(84, 10))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.classifier(torch.flatten(self.feature_extractor(x), 1))
        return logits, F.softmax(logits, dim=1)


def _lenet() -> tuple[Any, Any]:
    from deepspeed.profiling.flops_profiler import get_model_profile as deepspeed_profile

    from deepshard.profiler import get_model_profile

    shape = (1024, 1, 32, 32)
    ours = get_model_profile(_LeNet5(), input_shape=shape, print_profile=False, warm_up=0)
    with contextlib.redirect_stdout(io.StringIO()):
        theirs = deepspeed_profile(
            _LeNet5(), input_shape=shape, print_profile=False, as_string=False, warm_up=0
        )
    return ours, theirs


def _parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per variant and round")
    parser.add_argument("--warmup", type=int, default=1, help="untimed profiled steps first")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--json", type=Path, help="also write the ratios as JSON (for run.py)")
    args = parser.parse_args()
    args.variants = args.variants.split(",")
    unknown = sorted(set(args.variants) - set(VARIANTS))
    if unknown:
        parser.error(f"--variants: unknown {unknown}; choose from {','.join(VARIANTS)}")
    args.missing = {}
    if importlib.util.find_spec("deepspeed") is None:
        args.missing["deepspeed"] = "deepspeed is not importable; install the bench group"
        args.variants = [v for v in args.variants if v != "deepspeed"]
        print(f"skipped: deepspeed ({args.missing['deepspeed']}); LeNet-5 is not compared")
    return args


def _write_json(args: argparse.Namespace, rounds: list[dict[str, float]]) -> None:
    """Round-by-round ratios of each DeepShard variant to every other profiler and to plain."""
    rows = [
        _bench_json.ratio_row(ours, theirs, "step time", [r[ours] / r[theirs] for r in rounds])
        for ours in ("deepshard-fwd", "deepshard", "deepshard-fwd-eager", "deepshard-eager")
        for theirs in ("deepspeed", "flop_counter", "plain")
        if ours in rounds[0] and theirs in rounds[0]
    ]
    figures = {v: {"time_s": [r[v] for r in rounds], "peak_mib": None} for v in rounds[0]}
    _bench_json.write(args.json, "profiler", rows, figures, args.missing)


def main() -> int:
    args = _parse()
    device = torch.device(args.device)
    print(f"tiny Llama: hidden {args.hidden}, {args.layers} layers, batch {args.batch} x "
          f"seq {args.seq}, {device}, torch {torch.__version__}")  # fmt: skip
    rounds = _race(args, device)
    met = _report_times(rounds)
    _write_json(args, rounds)
    for variant, (flops, read_s) in _forward_flops(args, device).items():
        print(f"forward FLOPs {variant:<20}{flops:>16,}   first read {1e3 * read_s:8.2f} ms")
    if args.missing:  # the target needs DeepSpeed: not decided, not failed
        return 0
    ours, theirs = _lenet()
    print(f"LeNet-5 (flops, macs, params): deepshard {ours}, deepspeed {theirs}")
    return 0 if met and ours == theirs else 1


if __name__ == "__main__":
    sys.exit(main())
