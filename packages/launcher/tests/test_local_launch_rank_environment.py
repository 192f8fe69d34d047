"""Real local launches: every rank's variables, arguments, module mode, devices and cores.

Each probe rank writes what it saw to a JSON file; the expectations are derived from the
launch's own layout (rank r of n on one node), never from a stored transcript.
"""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from deepshard.launcher import split_cores
from deepshard.launcher._cores import available_cpus, core_groups
from deepshard.testing import import_beside

_probes = import_beside(__file__, "_probes.py")
PAYLOAD = "a b'; touch pwned; '\"; touch pwned; \"$(touch pwned) * $HOME"


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def _job(tmp_path: Path) -> Path:
    (tmp_path / "out").mkdir()
    (tmp_path / "probe.py").write_text(_probes.PROBE)
    return tmp_path


def _check_layout(records: list[dict], world: int, port: int) -> None:
    assert [r["env"]["RANK"] for r in records] == [str(rank) for rank in range(world)]
    for rank, record in enumerate(records):
        env = record["env"]
        assert env["LOCAL_RANK"] == str(rank)
        assert env["WORLD_SIZE"] == env["LOCAL_WORLD_SIZE"] == env["LOCAL_SIZE"] == str(world)
        assert (env["CROSS_RANK"], env["CROSS_SIZE"]) == ("0", "1")
        assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("127.0.0.1", str(port))
        assert env["DEEPSHARD_RESTART_COUNT"] == "0"


def test_two_ranks_get_their_place_and_arguments_verbatim(tmp_path: Path) -> None:
    job = _job(tmp_path)
    port = _free_port()
    # .deepshard_env lines reach the ranks too (the launch directory's file).
    (job / ".deepshard_env").write_text("# extra\nDEEPSHARD_FROM_FILE=x=y 'z'\n")
    env = _probes.launcher_env(DEEPSHARD_PROBE=PAYLOAD)
    done = _probes.ds_launch(
        "--nproc_per_node",
        "2",
        "--master_port",
        str(port),
        "probe.py",
        "out",
        PAYLOAD,
        "--plain",
        cwd=job,
        env=env,
    )
    assert done.returncode == 0, done.stderr
    records = _probes.records(job / "out")
    _check_layout(records, 2, port)
    for rank, record in enumerate(records):
        assert record["argv"] == ["out", PAYLOAD, "--plain", f"--local_rank={rank}"]
        assert record["env"]["DEEPSHARD_PROBE"] == PAYLOAD
        assert record["env"]["OMP_NUM_THREADS"] == "1"  # the user's setting is kept
        assert record["env"]["CUDA_VISIBLE_DEVICES"] is None  # no accelerator: nothing narrowed
        assert record["cwd"] == str(job)
    assert not list(job.glob("pwned*")) and not list((job / "out").glob("pwned*"))


def test_four_ranks_as_a_module_split_the_cores(tmp_path: Path) -> None:
    job = _job(tmp_path)
    (job / "probepkg").mkdir()
    (job / "probepkg" / "__init__.py").write_text("")
    (job / "probepkg" / "main.py").write_text(_probes.PROBE)
    env = _probes.launcher_env()
    del env["OMP_NUM_THREADS"]
    done = _probes.ds_launch(
        "--nproc_per_node",
        "4",
        "--master_port",
        "0",
        "--no_local_rank",
        "-m",
        "probepkg.main",
        "out",
        cwd=job,
        env=env,
    )
    assert done.returncode == 0, done.stderr
    records = _probes.records(job / "out")
    port = int(records[0]["env"]["MASTER_PORT"])
    assert port != 0  # --master_port 0 picked a real port, the same for every rank
    _check_layout(records, 4, port)
    threads = str(max(1, len(core_groups(available_cpus())) // 4))
    for record in records:
        assert record["name"] == "__main__"  # run as python -m
        assert record["argv"] == ["out"]  # --no_local_rank
        assert record["env"]["OMP_NUM_THREADS"] == threads


def test_ranks_see_their_nodes_devices_and_are_pinned_to_their_cores(tmp_path: Path) -> None:
    job = _job(tmp_path)
    port = _free_port()
    # Four (pretend) accelerators; slots 1 and 3 are chosen: each rank sees exactly those two.
    env = _probes.launcher_env(DEEPSHARD_NUM_ACCELERATORS="4")
    done = _probes.ds_launch(
        "--include",
        "localhost:1,3",
        "--bind_cores_to_rank",
        "--master_port",
        str(port),
        "probe.py",
        "out",
        cwd=job,
        env=env,
    )
    assert done.returncode == 0, done.stderr
    records = _probes.records(job / "out")
    _check_layout(records, 2, port)
    expected = split_cores(2)
    for record, (cpus, _) in zip(records, expected, strict=True):
        assert record["env"]["CUDA_VISIBLE_DEVICES"] == "1,3"
        assert record["cpus"] == list(cpus)
    assert {cpu for record in records for cpu in record["cpus"]} <= set(available_cpus())


def test_bind_core_list_pins_to_the_listed_cpu(tmp_path: Path) -> None:
    job = _job(tmp_path)
    last = available_cpus()[-1]
    done = _probes.ds_launch(
        "--bind_core_list",
        str(last),
        "--master_port",
        str(_free_port()),
        "probe.py",
        "out",
        cwd=job,
    )
    assert done.returncode == 0, done.stderr
    (record,) = _probes.records(job / "out")
    assert record["cpus"] == [last]


def test_no_ssh_nodes_form_one_world(tmp_path: Path) -> None:
    # Two ds-launch processes, each told which node it is, make a 3-rank world of two nodes.
    job = _job(tmp_path)
    (job / "hostfile").write_text("node-a slots=2\nnode-b slots=1\n")
    port = str(_free_port())
    runs = [
        _probes.ds_launch(
            "-H",
            "hostfile",
            "--no_ssh",
            "--node_rank",
            str(node),
            "--master_addr",
            "127.0.0.1",
            "--master_port",
            port,
            "probe.py",
            "out",
            cwd=job,
        )
        for node in (0, 1)
    ]
    assert [run.returncode for run in runs] == [0, 0], [run.stderr for run in runs]
    records = _probes.records(job / "out")
    keys = ("RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "CROSS_RANK", "CROSS_SIZE")
    assert [tuple(record["env"][key] for key in keys) for record in records] == [
        ("0", "0", "2", "0", "2"),
        ("1", "1", "2", "0", "2"),
        ("2", "0", "1", "1", "2"),
    ]
    assert {r["env"]["WORLD_SIZE"] for r in records} == {"3"}


@pytest.mark.parametrize("flags", [["--nproc_per_node", "2"], ["-H", "missing-hostfile"]])
def test_dry_run_prints_and_starts_nothing(tmp_path: Path, flags: list[str]) -> None:
    job = _job(tmp_path)
    done = _probes.ds_launch("--dry_run", *flags, "probe.py", "out", cwd=job)
    assert not list((job / "out").iterdir())
    if flags[0] == "-H":
        assert done.returncode == 1
        assert "ds-launch: error: hostfile 'missing-hostfile' does not exist" in done.stderr
        return
    assert done.returncode == 0, done.stderr
    assert "node 0 localhost: ranks 0-1, slots 0,1" in done.stdout
    for rank in (0, 1):
        assert f"rank {rank} (local rank {rank} on localhost):" in done.stdout
        assert f"RANK={rank} LOCAL_RANK={rank} WORLD_SIZE=2" in done.stdout
        assert f"probe.py out --local_rank={rank}" in done.stdout
