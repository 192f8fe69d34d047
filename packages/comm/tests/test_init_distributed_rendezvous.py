"""init_distributed for real: two torchrun-style processes, and a world of one with no launcher."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

from deepshard.comm import DistInfo

# Each process joins, checks the group with an all-reduce, calls init_distributed again (which
# must not re-initialise) and prints its DistInfo as JSON on the last line.
_RANK_SCRIPT = """
import dataclasses, json, sys
import torch, torch.distributed as dist
from deepshard.comm import init_distributed
from deepshard.interface.errors import CommError

info = init_distributed()
total = torch.tensor([float(info.rank + 1)])
dist.all_reduce(total)
again = init_distributed()
assert again == dataclasses.replace(info, master_addr=again.master_addr,
                                    master_port=again.master_port), (again, info)
try:
    init_distributed(env={"RANK": "7", "WORLD_SIZE": "9"})
    mismatch = "no error"
except CommError as error:
    mismatch = str(error)
timeout = dist.distributed_c10d._get_default_group()._get_backend(
    torch.device("cpu")).options._timeout.total_seconds()
dist.destroy_process_group()
print(json.dumps({"info": dataclasses.asdict(info), "total": total.item(),
                  "mismatch": mismatch, "timeout_s": timeout}))
"""

_LAUNCHER_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "OMPI_COMM_WORLD_RANK",
    "SLURM_PROCID",
    "DEEPSHARD_TIMEOUT",
    "TORCHELASTIC_USE_AGENT_STORE",
)


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_VARS}
    env.update(OMP_NUM_THREADS="1", DEEPSHARD_ACCELERATOR="cpu", **extra)
    return env


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def _run(envs: list[dict[str, str]]) -> list[dict[str, object]]:
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _RANK_SCRIPT],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for env in envs
    ]
    outputs = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=120)
            assert proc.returncode == 0, err
            outputs.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return outputs


@pytest.mark.slow  # over 4 s (subprocesses / a deliberate hang); the main run has it
@pytest.mark.timeout(180)
def test_two_torchrun_style_processes_join() -> None:
    port = _free_port()
    envs = [
        _clean_env(
            RANK=str(r),
            WORLD_SIZE="2",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            DEEPSHARD_TIMEOUT="2",
        )
        for r in range(2)
    ]
    results = _run(envs)
    for rank, result in enumerate(results):
        assert DistInfo(**result["info"]) == DistInfo(  # type: ignore[arg-type]
            rank=rank,
            world_size=2,
            local_rank=rank,
            local_world_size=2,
            master_addr="127.0.0.1",
            master_port=port,
            backend="gloo",
        )
        assert result["total"] == 1.0 + 2.0
        assert "rank 7 of 9" in str(result["mismatch"])
        assert result["timeout_s"] == 120.0  # DEEPSHARD_TIMEOUT=2 minutes


@pytest.mark.slow  # over 4 s (subprocesses / a deliberate hang); the main run has it
@pytest.mark.timeout(180)
def test_no_launcher_is_a_world_of_one() -> None:
    (result,) = _run([_clean_env()])
    info = DistInfo(**result["info"])  # type: ignore[arg-type]
    assert (info.rank, info.world_size, info.local_rank, info.local_world_size) == (0, 1, 0, 1)
    assert info.master_addr == "127.0.0.1"
    assert info.master_port is not None and info.master_port > 0
    assert result["total"] == 1.0
    assert result["timeout_s"] == 600.0  # the 10-minute default


def test_backend_failure_is_a_comm_error_naming_the_backend(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import torch.distributed as dist

    from deepshard.comm import init_distributed
    from deepshard.interface.errors import CommError

    def no_nccl(backend: str, **kwargs: object) -> None:
        # What torch raises for nccl on a machine without NVIDIA GPUs.
        raise RuntimeError("ProcessGroupNCCL is only supported with GPUs, no GPUs found!")

    monkeypatch.setattr(dist, "init_process_group", no_nccl)
    with pytest.raises(CommError, match=r"'nccl'.*no GPUs found.*backend='gloo'"):
        init_distributed(backend="nccl", env={})
    assert not dist.is_initialized()


def test_world_of_one_with_a_remote_master_addr_is_a_comm_error() -> None:
    import torch.distributed as dist

    from deepshard.comm import init_distributed
    from deepshard.interface.errors import CommError

    # 192.0.2.1 (TEST-NET-1, RFC 5737) is never this host's address.
    with pytest.raises(CommError, match=r"MASTER_ADDR='192\.0\.2\.1'.*MASTER_PORT"):
        init_distributed(backend="gloo", env={"MASTER_ADDR": "192.0.2.1"})
    assert not dist.is_initialized()


def test_dist_backend_is_deepspeeds_name_for_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.distributed as dist

    from deepshard.comm import init_distributed
    from deepshard.interface.errors import CommError, ConfigError

    asked: list[str] = []

    def record(backend: str, **kwargs: object) -> None:
        asked.append(backend)
        raise RuntimeError("stop here")

    monkeypatch.setattr(dist, "init_process_group", record)
    with pytest.raises(CommError):
        init_distributed(dist_backend="gloo", env={})
    assert asked == ["gloo"]
    with pytest.raises(ConfigError, match=r"dist_backend='gloo'.*disagree"):
        init_distributed(backend="nccl", dist_backend="gloo", env={})
