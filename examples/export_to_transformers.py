"""Export a DeepShard checkpoint to a Hugging Face folder that ``from_pretrained`` loads.

    uv run --all-packages ds-launch --nproc_per_node 2 examples/export_to_transformers.py

Trains a tiny Llama 3 steps at ZeRO-3 on 2 ranks (parameters partitioned), saves a checkpoint,
then rank 0 runs ``ds-checkpoint export CKPT HF --dtype bf16 --config config.json`` (whole
tensors, consolidated from the shards, in bf16), loads the export with
``LlamaForCausalLM.from_pretrained`` and checks its logits equal those of the trained weights
rounded to bf16 (both evaluated in fp32).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

import deepshard.engine as ds

os.environ.setdefault("HF_HUB_OFFLINE", "1")
from transformers import LlamaConfig, LlamaForCausalLM

SEQ = 32


def main() -> None:
    """Train, save, export on rank 0, reload with transformers and compare the logits."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                         max_position_embeddings=SEQ, tie_word_embeddings=False)  # fmt: skip
    ds_config = {
        "train_micro_batch_size_per_gpu": 2,
        "steps_per_print": 1_000_000,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    }
    engine = ds.initialize(model=LlamaForCausalLM(config), config=ds_config).engine
    text = torch.frombuffer(bytearray(Path(__file__).read_bytes()), dtype=torch.uint8).long()
    ids = text[: 2 * SEQ].view(2, SEQ)
    for _ in range(3):
        on_device = ids.to(engine.device)
        engine.backward(engine(input_ids=on_device, labels=on_device).loss)
        engine.step()
    box = [tempfile.mkdtemp() if engine.global_rank == 0 else ""]  # one folder for every rank
    dist.broadcast_object_list(box, src=0)
    root = Path(box[0])
    engine.save_checkpoint(root / "ckpt")
    # The trained weights, whole, on every rank (a ZeRO-3 gather): the reference below.
    trained = LlamaForCausalLM(config)
    trained.load_state_dict({n: w.float() for n, w in engine.module_state_dict().items()})
    if engine.global_rank == 0:
        config.save_pretrained(root)
        tool = Path(sys.executable).with_name("ds-checkpoint")
        subprocess.run([str(tool), "export", str(root / "ckpt"), str(root / "hf"),
                        "--dtype", "bf16", "--config", str(root / "config.json")],
                       check=True, timeout=120)  # fmt: skip
        exported = LlamaForCausalLM.from_pretrained(root / "hf", torch_dtype=torch.bfloat16)
        assert all(p.dtype == torch.bfloat16 for p in exported.parameters())
        with torch.no_grad():  # compare in fp32: the trained weights rounded to bf16, as exported
            for p in trained.parameters():
                p.copy_(p.bfloat16().float())
            got = exported.float()(input_ids=ids).logits
            want = trained(input_ids=ids).logits
        err = (got - want).abs().max().item()
        assert err == 0.0, f"exported logits differ from the trained model's by {err}"
        print(f"export_to_transformers OK: {root / 'hf'} loads with from_pretrained, bf16 weights' "
              f"logits equal the trained model's (max |diff| {err})")  # fmt: skip
        shutil.rmtree(root)


if __name__ == "__main__":
    main()
