"""Pretrain a small Llama-style model on the Python standard library's own source code.

Run from the repository root (2 CPU ranks; ``--nproc_per_node <GPUs>`` on a GPU machine):

    uv run --all-packages ds-launch --nproc_per_node 2 examples/pretrain/train.py

What it does:

* **Data.** Every ``.py`` file of this interpreter's standard library, read as bytes (the
  vocabulary is the 256 byte values, so no tokenizer and no download). The sorted file list is
  split deterministically: every tenth file is held out for evaluation, the rest is training
  text. A training batch is a set of random windows whose positions come from a generator
  seeded by (seed, step, rank), so a resumed run reads exactly what an uninterrupted one would
  without any loader state in the checkpoint.
* **Model.** A Hugging Face ``LlamaForCausalLM`` built from a config (random init; the size
  flags below), trained by ``deepshard.engine`` with the ZeRO stage, precision, optimizer, LR
  schedule and FLOPs profiler that ``ds_config.json`` sets (ZeRO-3, bf16 by default). The
  schedule's ``total_num_steps`` follows ``--steps``.
* **Progress.** Rank 0 shows a progress bar with loss, lr, tokens/s and ETA (a live bar in a
  terminal; under ``ds-launch``, whose relay is line-based, the same bar as a log line every
  ``--log-every`` steps), logs the held-out
  loss every ``--eval-every`` steps (and at the start and the end), and the engine prints the
  FLOPs profile of step ``flops_profiler.profile_step`` once.
* **Checkpoints.** Every ``--save-every`` steps and at the end, under ``<out>/checkpoints``.
  Running the same command again resumes from the latest one and says so; a run that already
  reached ``--steps`` only evaluates.
"""

from __future__ import annotations

import argparse
import json
import os
import sysconfig
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

import deepshard.engine as ds

HERE = Path(__file__).resolve().parent
VOCAB = 256  # byte values
HELD_OUT_EVERY = 10  # every tenth file of the sorted list is held out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line: run length, output folder and model size."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--config",
        type=Path,
        default=HERE / "ds_config.json",
        help="DeepSpeed-style JSON config (default: ds_config.json beside this file)",
    )
    p.add_argument(
        "--out",
        type=Path,
        default=Path("runs/pretrain"),
        help="output folder; checkpoints go to <out>/checkpoints",
    )
    p.add_argument("--steps", type=int, default=120, help="total optimizer steps")
    p.add_argument("--eval-every", type=int, default=20, help="held-out evaluation interval")
    p.add_argument("--eval-batches", type=int, default=4, help="held-out batches per evaluation")
    p.add_argument(
        "--log-every",
        type=int,
        default=5,
        help="progress-line interval when the output is not a terminal",
    )
    p.add_argument("--save-every", type=int, default=40, help="checkpoint interval (steps)")
    p.add_argument(
        "--data",
        type=Path,
        default=None,
        help="folder of text files to train on (default: the standard library)",
    )
    p.add_argument("--glob", default="*.py", help="which files of --data to read")
    p.add_argument("--seq-len", type=int, default=128, help="tokens (bytes) per sample")
    p.add_argument("--hidden-size", type=int, default=384)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--cpu-bf16",
        action="store_true",
        help="keep the config's bf16 on a CPU-only machine (slow there)",
    )
    p.add_argument("--local_rank", type=int, default=-1, help="set by ds-launch; unused")
    args = p.parse_args(argv)
    for name in ("steps", "eval_every", "eval_batches", "log_every", "save_every", "seq_len"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.hidden_size % args.heads:
        p.error(f"--hidden-size ({args.hidden_size}) must be a multiple of --heads ({args.heads})")
    return args


def read_corpus(root: Path, pattern: str) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``(train bytes, held-out bytes, files read)`` of the files under ``root``.

    The file list is sorted, so every machine with the same Python makes the same split.
    """
    files = sorted(f for f in root.rglob(pattern) if f.is_file() and "site-packages" not in f.parts)
    train: list[bytes] = []
    held_out: list[bytes] = []
    for i, path in enumerate(files):
        (held_out if i % HELD_OUT_EVERY == 0 else train).append(path.read_bytes())
    if not held_out or not train:
        raise SystemExit(
            f"--data {root}: found {len(files)} files matching --glob {pattern!r}; need at least "
            "2 (every tenth is held out for evaluation): point --data at a folder of text files"
        )
    as_tensor = lambda parts: torch.frombuffer(bytearray(b"\n".join(parts)), dtype=torch.uint8)  # noqa: E731
    return as_tensor(train), as_tensor(held_out), len(files)


def windows(text: torch.Tensor, starts: torch.Tensor, seq_len: int) -> torch.Tensor:
    """The ``seq_len``-byte windows of ``text`` starting at ``starts``, as token ids."""
    offsets = starts[:, None] + torch.arange(seq_len)[None, :]
    return text[offsets].long()


def train_batch(
    text: torch.Tensor, *, step: int, rank: int, size: int, seq_len: int, seed: int
) -> torch.Tensor:
    """This rank's micro-batch of step ``step``: random windows, the same on every rerun."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step * 4099 + rank)
    starts = torch.randint(0, text.numel() - seq_len, (size,), generator=gen)
    return windows(text, starts, seq_len)


def eval_batches(text: torch.Tensor, *, count: int, size: int, seq_len: int) -> list[torch.Tensor]:
    """Fixed held-out batches: windows evenly spaced over the held-out text."""
    starts = torch.linspace(0, text.numel() - seq_len - 1, count * size).long()
    return [windows(text, chunk, seq_len) for chunk in starts.split(size)]


def build_model(args: argparse.Namespace) -> torch.nn.Module:
    """A randomly initialised Llama-style causal LM over bytes (nothing is downloaded)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=args.hidden_size, intermediate_size=args.hidden_size * 8 // 3,
        num_hidden_layers=args.layers, num_attention_heads=args.heads,
        num_key_value_heads=args.heads, max_position_embeddings=args.seq_len,
        tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(args.seed)  # every rank starts from the same weights
    return LlamaForCausalLM(config)


def load_config(path: Path, steps: int, cpu_bf16: bool) -> tuple[dict[str, Any], str]:
    """The JSON config with the schedule's length set to ``--steps``, and a note for the log.

    bf16 falls back to fp32 on a CPU-only machine unless ``--cpu-bf16`` is given: measured on
    this project's 2-core CI box, a bf16 step of the default model took 15x as long as fp32
    (CPUs without native bf16 matrix units emulate it).
    """
    config: dict[str, Any] = json.loads(path.read_text())
    note = ""
    bf16 = config.get("bf16", {})
    if bf16.get("enabled") and not torch.accelerator.is_available() and not cpu_bf16:
        bf16["enabled"] = False
        note = "bf16 -> fp32 on CPU (bf16 is far slower there; --cpu-bf16 keeps it)"
    params = config.get("scheduler", {}).get("params", {})
    if "total_num_steps" in params:
        params["total_num_steps"] = steps
        params["warmup_num_steps"] = min(params.get("warmup_num_steps", 0), steps)
    return config, note


@torch.no_grad()
def held_out_loss(engine: Any, batches: list[torch.Tensor]) -> float:
    """Mean loss over the fixed held-out batches (every rank runs them: ZeRO-3 gathers)."""
    engine.eval()
    losses = [float(engine(input_ids=b, labels=b).loss) for b in batches]
    engine.train()
    return sum(losses) / len(losses)


def resume(engine: Any, ckpt_dir: Path, say: Callable[[str], None]) -> int:
    """Load the latest checkpoint under ``ckpt_dir`` if there is one; the step to start from."""
    if not (ckpt_dir / "latest").is_file():
        say(f"no checkpoint in {ckpt_dir}: starting from step 0")
        return 0
    path, client = engine.load_checkpoint(ckpt_dir)
    say(
        f"resumed from {path} at step {engine.global_steps} "
        f"({client.get('tokens_seen', 0):,} tokens seen)"
    )
    return int(engine.global_steps)


def progress_bar(console: Console, *, enabled: bool) -> Progress:
    """Step count, bar, loss, lr, tokens/s, elapsed time and ETA (live only in a terminal)."""
    return Progress(
        TextColumn("step {task.completed}/{task.total}"),
        BarColumn(),
        TextColumn("loss {task.fields[loss]:.3f} lr {task.fields[lr]:.2e}"),
        TextColumn("{task.fields[tps]:,.0f} tok/s"),
        TimeElapsedColumn(),
        TextColumn("ETA"),
        TimeRemainingColumn(),
        console=console,
        disable=not enabled,
    )


def progress_text(
    step: int, total: int, *, loss: float, lr: float, tps: float, elapsed: float, eta: float
) -> str:
    """The bar as one log line, for output that is not a terminal (``ds-launch`` pipes it)."""
    done = round(20 * step / total)
    clock = lambda s: time.strftime("%H:%M:%S", time.gmtime(s))  # noqa: E731
    return (f"step {step}/{total} [{'#' * done}{'.' * (20 - done)}] loss {loss:.3f} "
            f"lr {lr:.2e} {tps:,.0f} tok/s {clock(elapsed)} ETA {clock(eta)}")  # fmt: skip


def train_step(engine: Any, text: torch.Tensor, step: int, args: argparse.Namespace) -> float:
    """One optimizer step (all its micro-batches); the last micro-batch's loss."""
    ga = engine.gradient_accumulation_steps()
    mb = engine.train_micro_batch_size_per_gpu()
    for micro in range(ga):
        batch = train_batch(
            text, step=step * ga + micro, rank=engine.global_rank, size=mb,
            seq_len=args.seq_len, seed=args.seed,
        ).to(engine.device)  # fmt: skip
        loss = engine(input_ids=batch, labels=batch).loss
        engine.backward(loss)
        engine.step()
    return float(loss.detach())


def main(argv: list[str] | None = None) -> None:
    """Train, evaluate and checkpoint as the module docstring describes."""
    args = parse_args(argv)
    root = args.data or Path(sysconfig.get_paths()["stdlib"])
    train_text, held_text, n_files = read_corpus(root, args.glob)
    model = build_model(args)
    n_params = sum(p.numel() for p in model.parameters())
    config, note = load_config(args.config, args.steps, args.cpu_bf16)
    engine, *_ = ds.initialize(model=model, config=config)
    is_main = engine.global_rank == 0
    console = Console(soft_wrap=True)

    def say(text: str) -> None:  # rank 0 logs; no rich markup: the bar line has [brackets]
        if is_main:
            console.print(text, markup=False, highlight=False)

    precision = "bf16" if engine.bfloat16_enabled() else "fp32"
    say(f"{root}: {n_files} files, {train_text.numel():,} train / {held_text.numel():,} "
        f"held-out bytes; model {n_params / 1e6:.1f}M parameters; {engine.world_size} ranks, "
        f"ZeRO-{engine.zero_optimization_stage()}, {precision} {note}")  # fmt: skip
    ckpt_dir = args.out / "checkpoints"
    step = resume(engine, ckpt_dir, say)
    mb = engine.train_micro_batch_size_per_gpu()
    evals = eval_batches(held_text, count=args.eval_batches, size=mb, seq_len=args.seq_len)
    evals = [b.to(engine.device) for b in evals]
    say(f"step {step}: held-out loss {held_out_loss(engine, evals):.4f}")
    tokens_per_step = engine.train_batch_size() * args.seq_len
    live = console.is_terminal  # under ds-launch the output is a pipe: log lines instead
    first_step, started = step, time.perf_counter()
    with progress_bar(console, enabled=is_main and live) as progress:
        task = progress.add_task("train", total=args.steps, completed=step, loss=0.0, lr=0.0,
                                 tps=0.0)  # fmt: skip
        while step < args.steps:
            began = time.perf_counter()
            loss = train_step(engine, train_text, step, args)
            step, lr = engine.global_steps, engine.get_lr()[0]
            tps = tokens_per_step / (time.perf_counter() - began)
            progress.update(task, completed=step, loss=loss, lr=lr, tps=tps)
            if not live and (step % args.log_every == 0 or step == args.steps):
                elapsed = time.perf_counter() - started
                eta = elapsed / (step - first_step) * (args.steps - step)
                say(progress_text(step, args.steps, loss=loss, lr=lr, tps=tps,
                                  elapsed=elapsed, eta=eta))  # fmt: skip
            if step % args.eval_every == 0 or step == args.steps:
                say(f"step {step}: train loss {loss:.4f} held-out loss "
                    f"{held_out_loss(engine, evals):.4f} lr {lr:.2e} {tps:,.0f} tok/s")  # fmt: skip
            if step % args.save_every == 0 or step == args.steps:
                engine.save_checkpoint(
                    ckpt_dir, client_state={"tokens_seen": step * tokens_per_step}
                )
                say(f"step {step}: checkpoint saved to {ckpt_dir / f'global_step{step}'}")
    say(f"done: {step} steps, checkpoints in {ckpt_dir}")


if __name__ == "__main__":
    main()
