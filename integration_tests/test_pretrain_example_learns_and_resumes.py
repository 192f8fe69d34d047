"""The README's main job (examples/pretrain/train.py) learns, checkpoints and resumes.

A shortened run (tiny model through the script's own flags, the shipped ds_config.json with
ZeRO-3 and the FLOPs profiler) is started twice through ``ds-launch`` on 2 CPU ranks:

* run 1 (24 steps): the held-out loss it logs at the end is at least 30% below the one it logs
  before training, the progress line and the FLOPs profile are printed, and a checkpoint of the
  last step exists;
* run 2 (same folder, 36 steps) says it resumed from that checkpoint at step 24, logs the same
  held-out loss there as run 1 logged at its end (the weights were restored, not re-initialised),
  trains only steps 25-36 and prints no second FLOPs profile.

About 1.5-2 minutes on a busy 2-core machine (most of it starting torch in 2 x 2 processes).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "examples" / "pretrain" / "train.py"
TINY = ["--hidden-size", "64", "--layers", "2", "--heads", "4", "--seq-len", "64",
        "--eval-every", "12", "--save-every", "12", "--eval-batches", "2"]  # fmt: skip
HELD_OUT = re.compile(r"step (\d+): .*?held-out loss ([0-9.]+)")


def _run(out: Path, steps: int) -> str:
    launcher = Path(sys.executable).with_name("ds-launch")
    command = [str(launcher), "--nproc_per_node", "2", "--master_port", "0", str(SCRIPT),
               "--out", str(out), "--steps", str(steps), *TINY]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    log = done.stdout + done.stderr
    assert done.returncode == 0, log[-4000:]
    return log


def _held_out(log: str) -> dict[int, float]:
    return {int(step): float(loss) for step, loss in HELD_OUT.findall(log)}


def test_pretrain_learns_saves_and_resumes(tmp_path: Path) -> None:
    first = _run(tmp_path, steps=24)
    losses = _held_out(first)
    assert sorted(losses) == [0, 12, 24], first[-3000:]
    assert losses[24] <= 0.7 * losses[0], f"held-out loss {losses[0]} -> {losses[24]}"
    assert "no checkpoint in" in first
    # Under ds-launch (a pipe) the progress bar comes as log lines: loss, lr, tokens/s, ETA.
    bar = r"step 24/24 \[#{20}\] loss [0-9.]+ lr [0-9.e+-]+ [0-9,]+ tok/s [0-9:]+ ETA [0-9:]+"
    assert re.search(bar, first), first[-3000:]
    assert first.count("FLOPs profiler") == 1
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "global_step24"
    assert (tmp_path / "checkpoints" / "global_step24").is_dir()

    second = _run(tmp_path, steps=36)
    assert re.search(r"resumed from \S*global_step24 at step 24", second), second[-3000:]
    resumed = _held_out(second)
    assert sorted(resumed) == [24, 36], second[-3000:]
    assert resumed[24] == losses[24]  # the restored weights, evaluated on the same batches
    assert resumed[36] < resumed[24]
    assert "FLOPs profiler" not in second  # profile_step 2 lies before the resumed step
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "global_step36"
