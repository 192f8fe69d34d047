"""The README's first python block runs as written (in this process: it joins a world of one and
destroys its process group at the end; torch is already imported, so this costs about a second)."""

from __future__ import annotations

from pathlib import Path

import torch.distributed as dist

from deepshard.testing import run_readme_example

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_first_python_block_runs() -> None:
    assert not dist.is_initialized()
    out = run_readme_example(README, in_process=True)
    assert out.count("grad norm") == 4 and "AdamW state on this rank" in out
