"""The short examples (examples/*.py beside the main job) run under ``ds-launch`` on 2 CPU ranks.

Each prints ``<name> OK: ...`` on rank 0 after its own checks (losses fall, a checkpoint resumed
at another ZeRO stage continues, exported bf16 logits match the trained weights). About 20-35 s
each on a busy 2-core machine, most of it starting torch and transformers in 2 processes.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = ["finetune_zero2", "offload", "reshard_checkpoint", "export_to_transformers"]


@pytest.mark.parametrize("name", EXAMPLES)
def test_example_runs_and_reports_success(name: str) -> None:
    launcher = Path(sys.executable).with_name("ds-launch")
    command = [str(launcher), "--nproc_per_node", "2", "--master_port", "0",
               str(REPO / "examples" / f"{name}.py")]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=90)
    log = done.stdout + done.stderr
    assert done.returncode == 0, log[-4000:]
    assert f"[rank 0] {name} OK:" in log, log[-4000:]


def test_readme_lists_every_example() -> None:
    readme = (REPO / "examples" / "README.md").read_text()
    for name in EXAMPLES:
        assert f"ds-launch --nproc_per_node 2 examples/{name}.py" in readme, name
