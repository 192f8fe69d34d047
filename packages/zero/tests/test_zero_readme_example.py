"""The README's first python block runs as written (in this process: it joins a world of one and
destroys its process group at the end; torch is already imported, so this costs about a second)."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import torch.distributed as dist

README = Path(__file__).resolve().parents[1] / "README.md"
# Launcher variables of an enclosing run would make the example join that world instead.
_LAUNCH_PREFIXES = ("OMPI_", "SLURM_", "TORCHELASTIC_")
_LAUNCH_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
)


def test_readme_first_python_block_runs(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(encoding="utf-8"), re.DOTALL)
    assert blocks, "README.md has no ```python block"
    for name in list(os.environ):
        if name in _LAUNCH_VARS or name.startswith(_LAUNCH_PREFIXES):
            monkeypatch.delenv(name)
    assert not dist.is_initialized()
    try:
        exec(compile(blocks[0], str(README), "exec"), {"__name__": "readme_example"})
    finally:
        if dist.is_initialized():  # the example failed before destroying its group
            dist.destroy_process_group()
    out = capsys.readouterr().out
    assert out.count("grad norm") == 4 and "AdamW state on this rank" in out
