"""One rank of a DeepSpeed 0.19.7 training run that writes a checkpoint (test helper, a script).

    python deepspeed_writer.py STAGE OUT_DIR STORE_FILE RANK WORLD [--universal-info]
        [--continue M]

Trains `model()` for `STEPS` AdamW steps at ZeRO ``STAGE`` on DeepSpeed's CPU accelerator over
gloo, calls ``engine.save_checkpoint(OUT_DIR)``, and rank 0 writes
``OUT_DIR/reference.safetensors``: every parameter's fp32 master and Adam moments as
DeepSpeed's own live-engine API returns them
(``safe_get_full_fp32_param`` / ``safe_get_full_optimizer_state``), the independent reference the
import is compared with, plus ``OUT_DIR/reference.json`` (losses, the Adam step, the steps run).
With ``--continue M`` the run then trains ``M`` more steps (inputs ``batch(STEPS + i, rank)``),
and each rank writes its losses of those steps to ``OUT_DIR/continued-<rank>.json`` and rank 0
the final fp32 masters to ``OUT_DIR/continued.safetensors``: what a resume from the checkpoint
must reproduce.

The world is joined through a FileStore (no ports). DeepSpeed's CPU backend would JIT-build its
shared-memory all-reduce op on every start (about a minute on a loaded box); the op only speeds
up CPU all-reduce, so the helper turns it off.
"""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta
from typing import Any

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch
import torch.distributed as dist

STEPS = 3
MICRO_BATCH = 2


class Tiny(torch.nn.Module):
    """Sizes that do not divide by 2, so ZeRO partitions cut parameters mid-way; one buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(5, 7)
        self.down = torch.nn.Linear(7, 3)
        self.register_buffer("offset", torch.arange(3, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x))) + self.offset


def model() -> Tiny:
    """The model every run starts from (seeded)."""
    torch.manual_seed(0)
    return Tiny()


def batch(step: int, rank: int) -> torch.Tensor:
    """The input of ``rank`` at ``step`` (the same on every run)."""
    generator = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(MICRO_BATCH, 5, generator=generator)


def loss_of(output: torch.Tensor) -> torch.Tensor:
    """The training loss of one micro-batch."""
    return output.pow(2).mean()


def config(stage: int) -> dict[str, object]:
    """The DeepSpeed config of the run."""
    return {
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "gradient_accumulation_steps": 1,
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": 1e-2, "weight_decay": 0.01, "torch_adam": True},
        },
        "zero_optimization": {"stage": stage},
    }


def _continue(engine: Any, steps: int, out: str, rank: int) -> None:
    """Train ``steps`` more steps after the save; record the losses and final masters."""
    from deepspeed.utils import safe_get_full_fp32_param
    from safetensors.torch import save_file

    losses = []
    for step in range(STEPS, STEPS + steps):
        loss = loss_of(engine(batch(step, rank)))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    with open(f"{out}/continued-{rank}.json", "w") as handle:
        json.dump(losses, handle)
    # Collective at stage 3: every rank calls, rank 0 keeps.
    final = {n: safe_get_full_fp32_param(p).clone() for n, p in engine.module.named_parameters()}
    if rank == 0:
        save_file({k: v.contiguous() for k, v in final.items()}, f"{out}/continued.safetensors")


def main(argv: list[str]) -> None:
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state
    from safetensors.torch import save_file

    stage, out, store, rank, world = int(argv[0]), argv[1], argv[2], int(argv[3]), int(argv[4])
    # `deepspeed.comm.torch` as an attribute is torch itself (a star import), hence sys.modules.
    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None  # see the docstring
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
    dist.init_process_group(
        "gloo",
        init_method=f"file://{store}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=120),
    )
    deepspeed.init_distributed(dist_backend="gloo")
    net = model()
    engine, _, _, _ = deepspeed.initialize(
        model=net, model_parameters=net.parameters(), config=config(stage)
    )
    losses = []
    for step in range(STEPS):
        loss = loss_of(engine(batch(step, rank)))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    # ds_to_universal requires the entry; DeepSpeed itself fails on client_state=None here.
    info = {"universal_checkpoint_info": {}} if "--universal-info" in argv else {}
    engine.save_checkpoint(out, client_state=info)
    reference: dict[str, torch.Tensor] = {}
    for name, param in engine.module.named_parameters():
        # Collective at stage 3: every rank calls, rank 0 keeps.
        reference[f"param.{name}"] = safe_get_full_fp32_param(param).clone()
        for key in ("exp_avg", "exp_avg_sq"):
            reference[f"{key}.{name}"] = safe_get_full_optimizer_state(param, key).clone()
    if "--continue" in argv:
        _continue(engine, int(argv[argv.index("--continue") + 1]), out, rank)
    if rank == 0:
        save_file({k: v.contiguous() for k, v in reference.items()}, f"{out}/reference.safetensors")
        summary = {"losses": losses, "steps": STEPS, "stage": stage, "world": world}
        with open(f"{out}/reference.json", "w") as handle:
            json.dump(summary, handle)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
