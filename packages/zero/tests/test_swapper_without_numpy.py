"""The NVMe swapper works where numpy is absent (it is no dependency of deepshard-zero).

The test environments have numpy (transformers brings it), so a fresh interpreter that cannot
import it runs a write/read round trip of fp32 and bf16 bytes at an offset.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

_SCRIPT = textwrap.dedent(
    """
    import sys
    sys.modules["numpy"] = None  # any import of numpy now fails
    from pathlib import Path
    import torch
    from deepshard.interface.config import AioConfig
    from deepshard.zero._swap import Swapper

    swapper = Swapper(Path(sys.argv[1]), AioConfig(block_size=1024), prefix="test")
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(3000).to(dtype)
        swapper.write("state", x, offset=96).wait()
        y = torch.empty_like(x)
        swapper.read("state", y, offset=96).wait()
        assert torch.equal(x, y), dtype
    swapper.close()
    print("ok")
    """
)


@pytest.mark.slow
def test_swap_round_trip_without_numpy(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-c", _SCRIPT, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().endswith("ok")
