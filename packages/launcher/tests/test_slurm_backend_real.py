"""``ds-launch --launcher slurm`` for real: a one-node SLURM on loopback, 2 ranks that all-reduce.

munged, slurmctld and slurmd are started once for this module from a configuration in a
temporary directory (see ``_slurm.py``); ``munge``, ``slurmctld``, ``slurmd`` and
``slurm-client`` are installed when missing. Without root rights the tests are skipped, saying
so. ``srun`` (started by ds-launch) finds the cluster through ``SLURM_CONF``.

The ranks are started by ``srun`` itself and read ``SLURM_PROCID`` and the step's variables
through ``deepshard.comm.init_distributed``; each writes what it saw to a JSON file and the test
compares that with the layout it asked for and the sum computed here.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from deepshard.testing import import_beside

_slurm = import_beside(__file__, "_slurm.py")
DS_LAUNCH = Path(sys.executable).parent / "ds-launch"
LAUNCH_TIMEOUT_S = 180

RANK_SCRIPT = """\
import json, os, sys
from pathlib import Path

import torch
import torch.distributed as dist
from deepshard.comm import init_distributed

info = init_distributed(backend="gloo")
value = torch.tensor([float(info.rank + 1)], dtype=torch.float64)
dist.all_reduce(value)
record = {
    "rank": info.rank,
    "world_size": info.world_size,
    "local_rank": info.local_rank,
    "local_world_size": info.local_world_size,
    "sum": value.item(),
    "slurm_procid": os.environ.get("SLURM_PROCID"),
    "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
}
Path(sys.argv[1], f"rank{info.rank}.json").write_text(json.dumps(record))
dist.destroy_process_group()
"""


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A running one-node cluster (skips the module when the machine cannot provide one)."""
    if not DS_LAUNCH.exists():
        pytest.skip(f"ds-launch is not installed beside {sys.executable}")
    root = tmp_path_factory.mktemp("slurm")
    start = time.monotonic()
    try:
        with _slurm.running_slurm(root) as running:
            took = time.monotonic() - start
            phases = ", ".join(f"{k} {v:.1f} s" for k, v in running.timings.items())
            print(f"\nSLURM on loopback ready in {took:.1f} s ({phases})")
            yield running
    except _slurm.Unavailable as reason:
        pytest.skip(str(reason))


@pytest.fixture
def job(tmp_path: Path) -> Path:
    """A job directory holding the rank script and an empty output directory."""
    (tmp_path / "out").mkdir()
    (tmp_path / "rank_script.py").write_text(RANK_SCRIPT)
    return tmp_path


def _ds_launch(
    cluster: Any, job: Path, *launcher_args: str
) -> tuple[list[str], subprocess.CompletedProcess[str]]:
    command = [
        str(DS_LAUNCH),
        "--launcher",
        "slurm",
        *launcher_args,
        str(job / "rank_script.py"),
        str(job / "out"),
    ]
    env = {**cluster.env, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        command,
        cwd=job,
        env=env,
        capture_output=True,
        text=True,
        timeout=LAUNCH_TIMEOUT_S,
        check=False,
    )
    return command, done


def _job_ids(cluster: Any) -> set[str]:
    """Ids of the jobs slurmctld knows (finished ones stay listed for MinJobAge seconds)."""
    done = subprocess.run(
        ["squeue", "-h", "-a", "-t", "all", "-o", "%i"],
        env=cluster.env,
        capture_output=True,
        text=True,
        timeout=20,
        check=True,
    )
    return set(done.stdout.split())


@pytest.mark.slow
def test_slurm_two_ranks_all_reduce(cluster: Any, job: Path) -> None:
    hostfile = job / "hostfile"
    hostfile.write_text(f"{_slurm.NODE} slots=2\n")
    command, done = _ds_launch(cluster, job, "--hostfile", str(hostfile))
    if done.returncode != 0:
        pytest.fail(
            f"{shlex.join(command)} exited {done.returncode}\nstdout:\n{done.stdout}\n"
            f"stderr:\n{done.stderr}\n{cluster.diagnostics()}"
        )
    files = sorted((job / "out").glob("rank*.json"))
    assert [f.name for f in files] == ["rank0.json", "rank1.json"], cluster.diagnostics()
    records = [json.loads(f.read_text()) for f in files]
    expected_sum = float(sum(rank + 1 for rank in range(2)))
    for record in records:
        assert record["world_size"] == 2
        assert record["local_world_size"] == 2
        assert record["local_rank"] == record["rank"]
        assert record["sum"] == expected_sum
        # srun started the rank itself: the rank is SLURM's task, not a child of a local agent.
        assert record["slurm_procid"] == str(record["rank"])
    assert len({record["slurm_job_id"] for record in records}) == 1


@pytest.mark.slow
def test_slurm_refuses_a_slot_filter_before_launching(cluster: Any, job: Path) -> None:
    # srun places tasks by count only: it cannot start "slot 1 of localhost" and not slot 0.
    hostfile = job / "hostfile"
    hostfile.write_text(f"{_slurm.NODE} slots=2\n")
    jobs_before = _job_ids(cluster)
    command, done = _ds_launch(
        cluster, job, "--hostfile", str(hostfile), "--include", f"{_slurm.NODE}:1"
    )
    assert done.returncode != 0, f"{shlex.join(command)} was accepted:\n{done.stdout}"
    assert "slurm" in done.stderr.lower(), done.stderr
    assert not list((job / "out").iterdir()), "a rank ran although the launch was refused"
    assert _job_ids(cluster) <= jobs_before, "a SLURM job was submitted before the refusal"
