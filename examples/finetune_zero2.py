"""Fine-tune a (tiny) Hugging Face model with ZeRO-2: save_pretrained, from_pretrained, train.

    uv run --all-packages ds-launch --nproc_per_node 2 examples/finetune_zero2.py

The "pretrained" model is a small ``LlamaForCausalLM`` built from a config and written with
``save_pretrained`` to a temporary folder (nothing is downloaded); every rank loads it back with
``from_pretrained`` and fine-tunes it on this file's own bytes with ZeRO-2. The config asks for
bf16, which falls back to fp32 on a CPU-only machine as the main job does (bf16 is emulated,
and far slower, on most CPUs).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import torch

import deepshard.engine as ds

os.environ.setdefault("HF_HUB_OFFLINE", "1")
from transformers import LlamaConfig, LlamaForCausalLM

STEPS, SEQ = 8, 32
CONFIG = {
    "train_micro_batch_size_per_gpu": 2,
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-3}},
    "zero_optimization": {"stage": 2},
    "bf16": {"enabled": torch.accelerator.is_available()},  # fp32 on CPU, as the main job
    "steps_per_print": 1_000_000,
}


def pretrained(folder: str) -> LlamaForCausalLM:
    """Write a tiny random Llama with ``save_pretrained`` and load it back (no download)."""
    torch.manual_seed(0)  # every rank writes, and so loads, the same weights
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                         max_position_embeddings=SEQ, tie_word_embeddings=False)  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(folder)
    return LlamaForCausalLM.from_pretrained(folder)


def batch(rank: int, step: int) -> torch.Tensor:
    """This rank's windows of this file's bytes for ``step`` (the fine-tuning "data set")."""
    text = torch.frombuffer(bytearray(Path(__file__).read_bytes()), dtype=torch.uint8).long()
    gen = torch.Generator().manual_seed(1000 * step + rank)
    starts = torch.randint(0, text.numel() - SEQ, (2,), generator=gen)
    return text[starts[:, None] + torch.arange(SEQ)]


def main() -> None:
    """Load, fine-tune ``STEPS`` steps, print the losses and the success line on rank 0."""
    with tempfile.TemporaryDirectory() as folder:
        model = pretrained(folder)
    engine, *_ = ds.initialize(model=model, config=CONFIG)
    losses = []
    for step in range(STEPS):
        ids = batch(engine.global_rank, step).to(engine.device)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    if engine.global_rank == 0:
        print("losses", " ".join(f"{x:.3f}" for x in losses))
        assert losses[-1] < losses[0], losses
        print(f"finetune_zero2 OK: ZeRO-{engine.zero_optimization_stage()} on "
              f"{engine.world_size} ranks, loss {losses[0]:.3f} -> {losses[-1]:.3f}")  # fmt: skip


if __name__ == "__main__":
    main()
