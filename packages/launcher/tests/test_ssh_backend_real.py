"""``ds-launch --launcher ssh`` for real: an sshd on 127.0.0.1, 2 ranks that all-reduce over gloo.

The sshd (see ``_sshd.py``) is started once for this module with a throwaway host key, a
throwaway client key and configs in a temporary directory; ``openssh-server`` is installed when
missing. Without root rights the tests are skipped, saying so. The ssh client options the
launcher's ssh needs (key, no host-key checking) reach it as ``--launcher_args "-F <config>"``;
the port only as ``--ssh_port``, so a launcher that drops it cannot log in.

Each rank writes what it saw (rank, world, the all-reduced sum, its arguments, the probe
variable, whether it runs inside an ssh session) to a JSON file; the test compares that with
the layout it asked for and with the sum computed here.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from deepshard.testing import import_beside

_sshd = import_beside(__file__, "_sshd.py")
DS_LAUNCH = Path(sys.executable).parent / "ds-launch"
LAUNCH_TIMEOUT_S = 180

# Rank body: join the world, all-reduce rank+1, record what arrived. The first argument is the
# output directory, the rest are the test's; ds-launch puts --local_rank=N in front of them.
RANK_SCRIPT = """\
import json, os, sys
from pathlib import Path

local_rank_flags = [a for a in sys.argv[1:] if a.startswith("--local_rank=")]
out_dir, *args = [a for a in sys.argv[1:] if a not in local_rank_flags]

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
    "args": args,
    "local_rank_flags": local_rank_flags,
    "probe": os.environ.get("DEEPSHARD_PROBE"),
    "in_ssh_session": "SSH_CONNECTION" in os.environ,
    "node": [os.environ.get("CROSS_RANK"), os.environ.get("CROSS_SIZE")],
    "cwd": os.getcwd(),
}
Path(out_dir, f"rank{info.rank}.json").write_text(json.dumps(record))
dist.destroy_process_group()
"""

# A shell author's nightmare: quotes of both kinds, command substitution, a glob, a newline.
PAYLOAD = "a b'; touch pwned; '\"; touch pwned; \"$(touch pwned)`touch pwned` * $HOME\nz"


@pytest.fixture(scope="module")
def sshd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A running sshd on 127.0.0.1 (skips the module when the machine cannot provide one)."""
    if not DS_LAUNCH.exists():
        pytest.skip(f"ds-launch is not installed beside {sys.executable}")
    root = tmp_path_factory.mktemp("sshd")
    try:
        with _sshd.running_sshd(root) as server:
            phases = ", ".join(f"{k} {v:.1f} s" for k, v in server.timings.items())
            print(f"\nsshd on 127.0.0.1:{server.port} ready ({phases})")
            yield server
    except _sshd.Unavailable as reason:
        pytest.skip(str(reason))


@pytest.fixture
def job(tmp_path: Path) -> Iterator[Path]:
    """A job directory holding the rank script; stray ranks are killed after the test."""
    (tmp_path / "out").mkdir()
    (tmp_path / "work").mkdir()
    (tmp_path / "rank_script.py").write_text(RANK_SCRIPT)
    yield tmp_path
    # Ranks started through sshd live outside our process tree; their command line names the
    # script in tmp_path, which is unique to this test.
    _sshd.kill_processes_with(str(tmp_path / "rank_script.py"))


def _launch(
    job: Path, server: Any, hostfile_lines: list[str], *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    hostfile = job / "hostfile"
    hostfile.write_text("\n".join(hostfile_lines) + "\n")
    command = [
        str(DS_LAUNCH),
        "--hostfile",
        str(hostfile),
        "--launcher",
        "ssh",
        "--ssh_port",
        str(server.port),
        "--launcher_args",
        f"-F {shlex.quote(str(server.client_config))}",
        # A free port from the kernel: 29500, the default, is what every other job on a
        # shared machine tries first.
        "--master_port",
        "0",
        str(job / "rank_script.py"),
        str(job / "out"),
        *args,
    ]
    run_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    done = subprocess.run(
        command,
        cwd=job / "work",
        env=run_env,
        capture_output=True,
        text=True,
        timeout=LAUNCH_TIMEOUT_S,
        check=False,
    )
    if done.returncode != 0:
        pytest.fail(
            f"{shlex.join(command)} exited {done.returncode}\nstdout:\n{done.stdout}\n"
            f"stderr:\n{done.stderr}\nsshd log:\n{server.log.read_text(errors='replace')[-3000:]}"
        )
    return done


def _records(job: Path, world_size: int) -> list[dict[str, Any]]:
    files = sorted((job / "out").glob("rank*.json"))
    assert [f.name for f in files] == [f"rank{r}.json" for r in range(world_size)]
    return [json.loads(f.read_text()) for f in files]


def _check_world(records: list[dict[str, Any]], local_world_sizes: list[int]) -> None:
    world_size = sum(local_world_sizes)
    expected_sum = float(sum(rank + 1 for rank in range(world_size)))
    # Ranks are placed node after node: global rank r's node and local rank follow from it.
    layout = [(n, local) for n, size in enumerate(local_world_sizes) for local in range(size)]
    for record in records:
        node, local_rank = layout[record["rank"]]
        assert record["world_size"] == world_size
        assert record["local_rank"] == local_rank
        assert record["local_world_size"] == local_world_sizes[node]
        assert record["sum"] == expected_sum
        assert record["in_ssh_session"], f"rank {record['rank']} was not started through ssh"
        assert record["local_rank_flags"] == [f"--local_rank={local_rank}"]
        # ds-launch tells each rank its node's position (CROSS_RANK) among CROSS_SIZE nodes.
        assert record["node"] == [str(node), str(len(local_world_sizes))]


@pytest.mark.slow
def test_one_ssh_node_two_ranks_all_reduce(sshd: Any, job: Path) -> None:
    _launch(job, sshd, ["127.0.0.1 slots=2"])
    records = _records(job, 2)
    _check_world(records, [2])
    # The rank runs in the directory ds-launch was started from, not in the ssh login's home.
    assert {r["cwd"] for r in records} == {str(job / "work")}


@pytest.mark.slow
def test_two_ssh_nodes_one_rank_each_all_reduce(sshd: Any, job: Path) -> None:
    # Two names for the same sshd: to ds-launch they are two nodes with one slot each.
    _launch(job, sshd, ["localhost slots=1", "127.0.0.1 slots=1"])
    _check_world(_records(job, 2), [1, 1])


def _pwned_files(places: list[Path]) -> list[Path]:
    found: list[Path] = []
    for place in places:
        if place.is_dir():
            found.extend(place.glob("pwned*"))
    return found


@pytest.mark.slow
def test_env_and_arguments_arrive_verbatim_over_ssh(sshd: Any, job: Path) -> None:
    places = [
        job,
        job / "work",
        job / "out",
        Path.home(),
        Path(tempfile.gettempdir()),
        Path("/tmp"),
        Path.cwd(),
    ]
    before = set(_pwned_files(places))
    _launch(
        job,
        sshd,
        ["localhost slots=1", "127.0.0.1 slots=1"],
        PAYLOAD,
        "--plain",
        env={"DEEPSHARD_PROBE": PAYLOAD},
    )
    records = _records(job, 2)
    _check_world(records, [1, 1])
    for record in records:
        assert record["probe"] == PAYLOAD
        assert record["args"][:2] == [PAYLOAD, "--plain"]
    assert set(_pwned_files(places)) == before, "a shell ran part of the payload"
