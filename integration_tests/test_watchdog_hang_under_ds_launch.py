"""A rank that sleeps inside a ZeRO-2 training step: ds-launch fails fast and names it.

Two ranks train through `deepshard.engine.initialize` (ZeRO stage 2 with overlapped
reduce-scatters, so the hang is caught in the collectives ZeRO issues, through the comms logger
the engine threads into ZeRO). In the third step rank 1 sleeps for a minute before `backward`.
With `comms_watchdog_s: 3` rank 0 must fail, and `ds-launch` must exit non-zero, within the
watchdog time plus the grace for answers and the launcher's teardown, not after the 10-minute
process-group timeout; its output must name rank 1 as the stuck rank, and the report must point
at the script's own line that issued the step's collectives.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from deepshard.interface.watchdog import parse_watchdog_line

BIN = Path(sys.executable).parent
WATCHDOG_S = 3.0
# The watchdog's grace for answers (interval 0.75 s + 1 s), rank 0's exit after its
# traceback, and ds-launch's teardown of the sleeping rank, with room for a loaded machine.
TEARDOWN_S = 12.0

SCRIPT = """\
import argparse, json, time
from pathlib import Path

import torch
import deepshard.engine as ds

parser = argparse.ArgumentParser()
parser.add_argument("out", type=Path)
parser.add_argument("--local_rank", type=int)
args = parser.parse_args()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
config = {
    "train_batch_size": 2,
    "train_micro_batch_size_per_gpu": 1,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
    "zero_optimization": {"stage": 2, "overlap_comm": True},
    "comms_watchdog_s": %(watchdog)r,
}
engine, _, _, _ = ds.initialize(model, config)
rank = torch.distributed.get_rank()
for step in range(4):
    loss = engine(torch.randn(1, 8)).pow(2).mean()
    if step == 2 and rank == 1:
        (args.out / "sleeping.json").write_text(json.dumps({"at": time.time()}))
        time.sleep(60)  # the stuck rank
    engine.backward(loss)  # THE-STEP-LINE
    engine.step()
"""


def _env() -> dict[str, str]:
    drop = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_", "CUDA_VISIBLE", "DEEPSHARD_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    env.update(OMP_NUM_THREADS="1", DEEPSHARD_NUM_ACCELERATORS="0")
    return env


def test_ds_launch_names_the_rank_that_sleeps_in_a_step(tmp_path: Path) -> None:
    if not (BIN / "ds-launch").exists():
        pytest.skip(f"ds-launch is not installed beside {sys.executable}")
    (tmp_path / "out").mkdir()
    (tmp_path / "train.py").write_text(SCRIPT % {"watchdog": WATCHDOG_S})
    launcher = [str(BIN / "ds-launch"), "--nproc_per_node", "2", "--master_port", "0"]
    done = subprocess.run(
        [*launcher, "train.py", "out"],
        cwd=tmp_path,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    ended = time.time()
    output = done.stdout + done.stderr
    assert done.returncode != 0, output
    slept = json.loads((tmp_path / "out" / "sleeping.json").read_text())["at"]
    assert WATCHDOG_S <= ended - slept <= WATCHDOG_S + TEARDOWN_S, output

    assert "ds-launch: stuck rank: 1\n" in done.stderr, output
    notice = next(line for line in done.stderr.splitlines() if "comms watchdog" in line)
    assert notice.startswith("ds-launch: the comms watchdog (DEEPSHARD_WATCHDOG_S) on rank 0")
    summaries = [s for s in map(parse_watchdog_line, output.splitlines()) if s is not None]
    assert summaries and {(s.rank, s.stuck) for s in summaries} == {(0, (1,))}, output
    step_line = 1 + SCRIPT.splitlines().index(
        next(line for line in SCRIPT.splitlines() if "THE-STEP-LINE" in line)
    )
    assert f"train.py:{step_line} in <module>" in summaries[0].what, output
    assert "CommError" in output
