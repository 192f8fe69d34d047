"""Save a checkpoint at ZeRO-2 and resume it at ZeRO-3: a load reshards to the new layout.

    uv run --all-packages ds-launch --nproc_per_node 2 examples/reshard_checkpoint.py

Trains a tiny Llama 4 steps at ZeRO-2 on 2 ranks and saves; a fresh engine at ZeRO-3 (another
partitioning of parameters, masters and Adam moments) loads that checkpoint directly and keeps
training: its first loss is below the last ZeRO-2 one (fresh weights would start at ~5.5).
Offline, ``ds-checkpoint reshard DIR OUT --dp N --stage S`` rewrites a checkpoint for another
world size or stage.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

import deepshard.engine as ds

os.environ.setdefault("HF_HUB_OFFLINE", "1")
from transformers import LlamaConfig, LlamaForCausalLM

SEQ = 32


def build(stage: int) -> ds.DeepShardEngine:
    """A tiny Llama (seeded: the same initial weights on every rank) under ZeRO ``stage``."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                         max_position_embeddings=SEQ, tie_word_embeddings=False)  # fmt: skip
    ds_config = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 1_000_000,
                 "optimizer": {"type": "AdamW", "params": {"lr": 3e-3}},
                 "zero_optimization": {"stage": stage}}  # fmt: skip
    return ds.initialize(model=LlamaForCausalLM(config), config=ds_config).engine


def train(engine: ds.DeepShardEngine, ids: torch.Tensor, steps: int) -> list[float]:
    """``steps`` optimizer steps on the fixed batch ``ids``; the losses."""
    losses, ids = [], ids.to(engine.device)
    for _ in range(steps):
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    return losses


def main() -> None:
    """ZeRO-2 train and save, ZeRO-3 load and continue; rank 0 prints the success line."""
    text = torch.frombuffer(bytearray(Path(__file__).read_bytes()), dtype=torch.uint8).long()
    ids = text[: 2 * SEQ].view(2, SEQ)
    first = build(stage=2)
    # Every rank saves to, and loads from, one folder: rank 0's temporary one, broadcast.
    box = [tempfile.mkdtemp() if first.global_rank == 0 else ""]
    dist.broadcast_object_list(box, src=0)
    root = box[0]
    before = train(first, ids, steps=4)
    first.save_checkpoint(root)
    second = build(stage=3)
    path, _ = second.load_checkpoint(root)
    after = train(second, ids, steps=3)
    dist.barrier()  # every rank has read the checkpoint before rank 0 deletes it
    if second.global_rank == 0:
        print("ZeRO-2 losses", " ".join(f"{x:.3f}" for x in before))
        print("ZeRO-3 losses", " ".join(f"{x:.3f}" for x in after), f"(from {Path(path).name})")
        assert second.global_steps == 7 and after[0] < before[-1], (before, after)
        stage = second.zero_optimization_stage()
        print(f"reshard_checkpoint OK: ZeRO-2 step 4 resumed at ZeRO-{stage}, "
              f"loss {before[-1]:.3f} -> {after[-1]:.3f}")  # fmt: skip
        shutil.rmtree(root)


if __name__ == "__main__":
    main()
