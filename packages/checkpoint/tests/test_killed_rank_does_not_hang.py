"""Two real gloo processes save; rank 1 is SIGKILLed half-way through its file. Rank 0 fails
with a `CheckpointError` naming rank 1 within its bounded wait instead of hanging, and the
previous checkpoint stays `latest`."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import torch

from deepshard.checkpoint import load

_RANK = textwrap.dedent(
    """
    import os, signal, sys
    from datetime import timedelta
    import torch
    import torch.distributed as dist
    from deepshard.checkpoint import save
    from deepshard.interface.errors import CheckpointError

    rank, root = int(sys.argv[1]), sys.argv[2]
    store = dist.FileStore(os.path.join(root, "store"), 2)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2,
                            timeout=timedelta(seconds=30))

    class KillRank1:
        def reached(self, point, r):
            if point == "mid_file" and r == 1:
                os.kill(os.getpid(), signal.SIGKILL)

    state = {"w": torch.full((64, 64), float(rank))}
    save({"w": torch.ones(4)}, os.path.join(root, "ckpt"), tag="first")
    try:
        save(state, os.path.join(root, "ckpt"), tag="second", hooks=KillRank1(), timeout_s=3.0)
    except CheckpointError as exc:
        print("CheckpointError:", exc, flush=True)
        os._exit(7)  # the process group cannot be torn down cleanly with a dead peer
    os._exit(0)
    """
)


def test_rank_zero_fails_promptly_when_rank_one_dies(tmp_path: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    ranks = [
        subprocess.Popen(
            [sys.executable, "-c", _RANK, str(r), str(tmp_path)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(2)
    ]
    try:
        out0, err0 = ranks[0].communicate(timeout=150)
        ranks[1].wait(timeout=30)
    finally:
        for proc in ranks:
            proc.kill()
    assert ranks[1].returncode == -9
    assert ranks[0].returncode == 7, (out0, err0)
    assert "rank 0: ranks [1] did not finish writing 'second' within 3.0 s" in out0
    assert not list((tmp_path / "ckpt").glob(".tmp-*"))
    target = {"w": torch.zeros(4)}
    assert load(tmp_path / "ckpt", target).path.name == "first"
    assert torch.equal(target["w"], torch.ones(4))
