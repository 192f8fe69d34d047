"""The README's example runs as written, in a fresh single-process interpreter."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).parents[1] / "README.md"


def test_the_readme_example_trains_on_one_cpu_rank(tmp_path: Path) -> None:
    match = re.search(r"```python\n(.*?)```", README.read_text(), re.DOTALL)
    assert match, "the README has no python example"
    script = tmp_path / "example.py"
    script.write_text(match.group(1))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DEEPSHARD_ACCELERATOR": "cpu"}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)  # a world of one, whatever launched pytest
    done = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
        cwd=tmp_path,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    # 64 samples in micro-batches of 4, 2 per step: 8 optimizer steps.
    assert done.stdout.startswith("8 steps, lr 1.00e-03, loss ")
