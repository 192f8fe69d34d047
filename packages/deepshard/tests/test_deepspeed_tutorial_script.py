"""A DeepSpeed tutorial-style script trains on 2 ranks with only its import line changed.

`_deepspeed_tutorial.py` is written as DeepSpeed's CIFAR-10 tutorial writes it
(``deepspeed.add_config_arguments``, ``deepspeed.initialize(args=..., model=...,
model_parameters=..., training_data=...)``, ``model_engine(inputs)``, ``backward``, ``step``,
``local_rank``). The test swaps ``import deepspeed`` for ``import deepshard.engine as deepspeed``,
runs it under ``ds-launch`` on 2 CPU ranks with the tutorial's kind of JSON config passed as
``--deepspeed --deepspeed_config``, and checks that it exits 0, the loss falls epoch after
epoch, both ranks end with the same weights after the expected number of steps, and the saved
``model.safetensors`` holds those weights.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

# multi-rank and over ~3 s: the main run covers it, the package tox env deselects it
pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).with_name("_deepspeed_tutorial.py")
LAUNCH = (
    str(Path(sys.executable).parent / "ds-launch"),
    "--nproc_per_node",
    "2",
    "--master_port",
    "0",
)
EPOCHS = 4
SAMPLES = 256  # the script's Blobs() size
MAX_LR = 1e-3
ARGS = ("--epochs", str(EPOCHS), "--save_dir", "out")
CONFIG = {
    "train_batch_size": 16,
    "steps_per_print": 2000,
    "optimizer": {
        "type": "Adam",
        "params": {"lr": MAX_LR, "betas": [0.8, 0.999], "eps": 1e-8, "weight_decay": 3e-7},
    },
    "scheduler": {
        "type": "WarmupLR",
        "params": {"warmup_min_lr": 0, "warmup_max_lr": MAX_LR, "warmup_num_steps": 10},
    },
    "gradient_clipping": 1.0,
    "prescale_gradients": False,
    "bf16": {"enabled": False},
    "fp16": {"enabled": False},
    "wall_clock_breakdown": False,
    "zero_optimization": {"stage": 1, "reduce_bucket_size": 5e8, "overlap_comm": True},
}


def _records(stdout: str) -> list[dict[str, Any]]:
    """The JSON objects the ranks printed (ds-launch may prefix each line)."""
    found = []
    for line in stdout.splitlines():
        start = line.find("{")
        if start >= 0:
            found.append(json.loads(line[start:]))
    return found


def test_the_tutorial_script_trains_on_two_ranks(tmp_path: Path) -> None:
    source = SCRIPT.read_text()
    assert source.count("import deepspeed\n") == 1
    (tmp_path / "train.py").write_text(
        source.replace("import deepspeed\n", "import deepshard.engine as deepspeed\n")
    )
    (tmp_path / "ds_config.json").write_text(json.dumps(CONFIG))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DEEPSHARD_ACCELERATOR": "cpu"}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    done = subprocess.run(
        [*LAUNCH, "train.py", "--deepspeed", "--deepspeed_config", "ds_config.json", *ARGS],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=tmp_path,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    records = _records(done.stdout)
    losses = [
        r["loss"] for r in sorted((r for r in records if "epoch" in r), key=lambda r: r["epoch"])
    ]
    assert len(losses) == EPOCHS, done.stdout
    assert all(later < earlier for earlier, later in itertools.pairwise(losses)), losses
    facts = sorted((r for r in records if "checksum" in r), key=lambda r: r["rank"])
    steps = EPOCHS * SAMPLES // CONFIG["train_batch_size"]
    for rank, fact in enumerate(facts):
        assert {k: v for k, v in fact.items() if k != "checksum"} == {
            "rank": rank,
            "local_rank": rank,
            "arg_local_rank": rank,
            "world_size": 2,
            "stage": 1,
            "steps": steps,
            "lr": [MAX_LR],
        }
    assert len(facts) == 2 and facts[0]["checksum"] == facts[1]["checksum"]
    saved = load_file(tmp_path / "out" / "model.safetensors")
    total = sum(t.double().sum().item() for t in saved.values())
    assert math.isclose(total, facts[0]["checksum"], rel_tol=1e-12)
    assert all(t.dtype == torch.float32 for t in saved.values())
