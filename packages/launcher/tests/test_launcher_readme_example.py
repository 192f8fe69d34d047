"""The README's first python block runs as written, in a fresh interpreter."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_first_python_block_runs(tmp_path: Path) -> None:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(encoding="utf-8"), re.DOTALL)
    assert blocks, "README.md has no ```python block"
    script = tmp_path / "readme_example.py"
    script.write_text(blocks[0], encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "OMPI_"))}
    done = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert "node 1 worker-1: ranks 2-3, slots 0,1" in done.stdout
