"""ZeRO-3 with the optimizer state and the parameters offloaded to the host (CPU).

    uv run --all-packages ds-launch --nproc_per_node 2 examples/offload.py

``offload_optimizer: cpu`` keeps the fp32 masters and Adam moments on the host (stepped by
DeepShard's CPU Adam); ``offload_param: cpu`` keeps the partitioned parameters there too, so the
device holds a layer's full weights only while it runs. On a CPU-only machine the "device" is
the host already, so this shows the configuration and that it trains; on GPUs it frees memory.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

import deepshard.engine as ds

os.environ.setdefault("HF_HUB_OFFLINE", "1")
from transformers import LlamaConfig, LlamaForCausalLM

STEPS, SEQ = 6, 32
CONFIG = {
    "train_micro_batch_size_per_gpu": 2,
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-3}},
    "zero_optimization": {
        "stage": 3,
        "offload_optimizer": {"device": "cpu"},
        "offload_param": {"device": "cpu"},
        "stage3_param_persistence_threshold": 0,  # partition (and offload) even small tensors
    },
    "steps_per_print": 1_000_000,
}


def main() -> None:
    """Train a tiny Llama a few steps on this file's bytes; rank 0 prints the success line."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                         max_position_embeddings=SEQ, tie_word_embeddings=False)  # fmt: skip
    engine, *_ = ds.initialize(model=LlamaForCausalLM(config), config=CONFIG)
    text = torch.frombuffer(bytearray(Path(__file__).read_bytes()), dtype=torch.uint8).long()
    ids = text[: 2 * SEQ].view(2, SEQ).to(engine.device)  # one fixed batch: the loss must fall
    losses = []
    for _ in range(STEPS):
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    if engine.global_rank == 0:
        print("losses", " ".join(f"{x:.3f}" for x in losses))
        assert losses[-1] < losses[0], losses
        print(f"offload OK: ZeRO-{engine.zero_optimization_stage()} with optimizer and "
              f"parameters on cpu, loss {losses[0]:.3f} -> {losses[-1]:.3f}")  # fmt: skip


if __name__ == "__main__":
    main()
