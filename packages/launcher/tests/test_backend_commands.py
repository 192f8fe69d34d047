"""The exact commands each backend would run, and the launches each refuses (nothing started)."""

from __future__ import annotations

import shlex
import signal
from pathlib import Path
from typing import Any

import pytest

from deepshard.interface.errors import LaunchError
from deepshard.launcher import LaunchOptions, LaunchPlan, RunOptions, WorldLayout, plan_launch

PY = "/opt/job/venv/bin/python"
THREE_HOSTS = "worker-0 slots=4\nworker-1 slots=4\nworker-2 slots=4\n"


def _plan(
    tmp_path: Path,
    hostfile_text: str | None,
    *,
    env: dict[str, str] | None = None,
    run: dict[str, Any] | None = None,
    **options: Any,
) -> LaunchPlan:
    if hostfile_text is not None:
        (tmp_path / "hostfile").write_text(hostfile_text)
        options.setdefault("hostfile", str(tmp_path / "hostfile"))
    environ = {"PATH": "/usr/bin", "DEEPSHARD_NUM_ACCELERATORS": "4", **(env or {})}
    return plan_launch(
        LaunchOptions(run=RunOptions(**{"script": "train.py", **(run or {})}), **options),
        environ=environ,
        cwd=str(tmp_path),
        home=str(tmp_path / "home"),
        python=PY,
    )


def _node_entry_words(remote: str) -> list[str]:
    words = shlex.split(remote)
    return words[words.index("-u") - 1 :]


def test_ssh_is_the_default_for_other_hosts(tmp_path: Path) -> None:
    plan = _plan(
        tmp_path,
        THREE_HOSTS,
        env={"NCCL_DEBUG": "INFO", "HOME_ONLY": "x"},
        include="worker-0:1,3@worker-2",
        ssh_port=2222,
        launcher_args="-F '/cfg dir/ssh_config'",
        master_port=29999,
        run={"script_args": ("--lr", "3e-4"), "log_dir": "/logs"},
    )
    assert plan.backend == "ssh" and plan.rendezvous == "worker-0:29999"
    assert [spec.stop_mode for spec in plan.specs] == ["stdin", "stdin"]
    for node_rank, (spec, host) in enumerate(
        zip(plan.specs, ["worker-0", "worker-2"], strict=True)
    ):
        assert list(spec.argv[:6]) == ["ssh", "-p", "2222", "-F", "/cfg dir/ssh_config", host]
        remote = spec.argv[6]
        assert len(spec.argv) == 7
        words = shlex.split(remote)
        assert words[:5] == ["cd", str(tmp_path), "&&", "exec", "env"]
        assert "NCCL_DEBUG=INFO" in words and "DEEPSHARD_RESTART_COUNT=0" in words
        assert not any(word.startswith("HOME_ONLY") for word in words)
        assert "PATH=/opt/job/venv/bin:$PATH" in words  # the node's PATH, behind the job's python
        entry = _node_entry_words(remote)
        world = next(word for word in entry if word.startswith("--world="))
        assert WorldLayout.decode(world.removeprefix("--world=")) == plan.layout
        assert entry == [
            PY,
            "-u",
            "-m",
            "deepshard.launcher.node",
            world,
            f"--node_rank={node_rank}",
            "--master_addr=worker-0",
            "--master_port=29999",
            "--watch_stdin",
            "--log_dir=/logs",
            "train.py",
            "--lr",
            "3e-4",
        ]
    assert [(node.host, node.slots) for node in plan.layout.nodes] == [
        ("worker-0", (1, 3)),
        ("worker-2", (0, 1, 2, 3)),
    ]


def test_pdsh_runs_one_command_and_finds_nodes_by_name(tmp_path: Path) -> None:
    plan = _plan(
        tmp_path,
        THREE_HOSTS,
        launcher="pdsh",
        ssh_port=2200,
        master_port=29999,
        run={"module": True, "script": "pkg.train", "script_args": ("--fmt", "100%")},
    )
    (spec,) = plan.specs
    assert list(spec.argv[:6]) == ["pdsh", "-S", "-f", "1024", "-w", "worker-0,worker-1,worker-2"]
    command = spec.argv[6]
    # pdsh replaces %h by each host's name; every other % is doubled to reach the node unchanged.
    assert "--node_host=%h" in command and "100%%" in command
    assert spec.env["PDSH_RCMD_TYPE"] == "ssh" and spec.env["PDSH_SSH_ARGS_APPEND"] == "-p 2200"
    assert spec.signal_map == ((signal.SIGINT, signal.SIGTERM),)
    job_id = next(w for w in shlex.split(command) if w.startswith("--job_id=")).split("=")[1]
    assert plan.policy.stop_command is not None
    stop = list(plan.policy.stop_command(2))
    assert stop[:6] == list(spec.argv[:6])
    assert shlex.split(stop[6]) == [
        PY,
        "-m",
        "deepshard.launcher.node",
        f"--stop_job={job_id}",
        "--signal=2",
    ]


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        ({}, ["-n", "12", "--nodes=3", "--ntasks-per-node=4"]),
        (
            {"include": "worker-0@worker-2"},
            ["-n", "8", "--nodes=2", "--ntasks-per-node=4", "--nodelist=worker-0,worker-2"],
        ),
        (
            {"num_nodes": 2, "num_gpus": 2},
            [
                "-n",
                "4",
                "--nodes=2",
                "--ntasks-per-node=2",
                "--nodelist=worker-0,worker-1",
                "--gpus-per-node=2",
            ],
        ),
        (
            {"include": "worker-1:0,1@worker-0:0,1"},
            ["-n", "4", "--nodes=2", "--ntasks-per-node=2", "--nodelist=worker-0,worker-1"],
        ),
    ],
    ids=["whole-hostfile", "hosts-filtered", "counts", "leading-slots"],
)
def test_srun_command(tmp_path: Path, options: dict[str, Any], expected: list[str]) -> None:
    plan = _plan(tmp_path, THREE_HOSTS, launcher="slurm", launcher_args="--qos high", **options)
    (spec,) = plan.specs
    assert list(spec.argv) == [
        "srun",
        *expected,
        "--kill-on-bad-exit=1",
        "--export=ALL",
        "--qos",
        "high",
        PY,
        "-u",
        "-m",
        "deepshard.launcher.script",
        "train.py",
    ]
    assert spec.env["DEEPSHARD_RESTART_COUNT"] == "0"
    # One SIGINT only makes srun print task states: a Ctrl-C reaches it as SIGTERM.
    assert spec.signal_map == ((signal.SIGINT, signal.SIGTERM),)


@pytest.mark.parametrize(
    ("hostfile", "options", "message"),
    [
        (THREE_HOSTS, {"include": "worker-0:1"}, "cannot choose slots [1] on worker-0"),
        (THREE_HOSTS, {"exclude": "worker-0:0"}, "cannot choose slots [1, 2, 3] on worker-0"),
        (THREE_HOSTS, {"include": "worker-0:0@worker-1"}, "same number of slots on every host"),
        ("a slots=2\nb slots=1\n", {}, "same number of slots on every host"),
        (
            THREE_HOSTS,
            {"run": {"script": "t.py", "bind_cores_to_rank": True}},
            "--bind_cores_to_rank is not available",
        ),
    ],
    ids=["non-leading-slot", "exclude-leading", "unequal-filter", "unequal-hostfile", "binding"],
)
def test_srun_refusals(
    tmp_path: Path, hostfile: str, options: dict[str, Any], message: str
) -> None:
    with pytest.raises(LaunchError, match=r"slurm|srun") as caught:
        _plan(tmp_path, hostfile, launcher="slurm", **options)
    assert message in str(caught.value)


def test_mpirun_command_and_refusals(tmp_path: Path) -> None:
    plan = _plan(
        tmp_path,
        THREE_HOSTS,
        launcher="openmpi",
        num_nodes=2,
        master_port=29999,
        env={"UCX_TLS": "tcp", "OTHER": "no"},
        launcher_args="--bind-to none",
    )
    (spec,) = plan.specs
    assert list(spec.argv) == [
        "mpirun",
        "-n",
        "8",
        "--host",
        "worker-0:4,worker-1:4",
        "--bind-to",
        "none",
        "-x",
        "DEEPSHARD_NUM_ACCELERATORS=4",
        "-x",
        "UCX_TLS=tcp",
        "-x",
        "DEEPSHARD_RESTART_COUNT=0",
        "-x",
        "MASTER_ADDR=worker-0",
        "-x",
        "MASTER_PORT=29999",
        PY,
        "-u",
        "-m",
        "deepshard.launcher.script",
        "train.py",
    ]
    for flag in ("include", "exclude"):
        with pytest.raises(LaunchError, match="openmpi launcher cannot honour --include/--exclude"):
            _plan(tmp_path, THREE_HOSTS, launcher="openmpi", **{flag: "worker-0"})
    with pytest.raises(LaunchError, match="--log_dir is not available with --launcher openmpi"):
        _plan(tmp_path, THREE_HOSTS, launcher="openmpi", run={"script": "t", "log_dir": "/l"})


def test_torchrun_over_ssh_and_locally(tmp_path: Path) -> None:
    plan = _plan(
        tmp_path,
        THREE_HOSTS,
        launcher="torchrun",
        num_nodes=2,
        master_port=29999,
        launcher_args="--max-restarts 2",
    )
    assert [spec.argv[0] for spec in plan.specs] == ["ssh", "ssh"]
    entry = _node_entry_words(plan.specs[1].argv[-1])
    assert "--torchrun" in entry and "--node_rank=1" in entry
    assert "--launcher_args=--max-restarts 2" in entry  # for torchrun, not for ssh
    assert plan.specs[1].argv[1] == "worker-1"

    local = _plan(
        tmp_path,
        None,
        launcher="torchrun",
        nproc_per_node=2,
        master_port=29999,
        env={"DEEPSHARD_NUM_ACCELERATORS": "0"},
        run={"script": "-", "module": True, "script_args": ("pkg.main", "--x")},
    )
    (agent,) = local.specs
    assert list(agent.argv) == [
        PY,
        "-m",
        "torch.distributed.run",
        "--nnodes=1",
        "--node_rank=0",
        "--nproc_per_node=2",
        "--master_addr=127.0.0.1",
        "--master_port=29999",
        "-m",
        "-",
        "pkg.main",
        "--x",
    ]
    assert dict(agent.shown_env) == {"CROSS_RANK": "0", "CROSS_SIZE": "1", "LOCAL_SIZE": "2"}


def test_local_launch_narrows_devices_per_node(tmp_path: Path) -> None:
    plan = _plan(
        tmp_path, None, include="localhost:1,3", master_port=29999, run={"script_args": ("x",)}
    )
    assert plan.backend == "local"
    envs = [dict(spec.shown_env) for spec in plan.specs]
    assert [env["CUDA_VISIBLE_DEVICES"] for env in envs] == ["1,3", "1,3"]
    assert [env["LOCAL_RANK"] for env in envs] == ["0", "1"]
    assert all("OMP_NUM_THREADS" not in env for env in envs)  # GPU ranks keep torch's default
    assert [list(spec.argv) for spec in plan.specs] == [
        [PY, "-u", "-m", "deepshard.launcher.script", "train.py", "x", "--local_rank=0"],
        [PY, "-u", "-m", "deepshard.launcher.script", "train.py", "x", "--local_rank=1"],
    ]
    with pytest.raises(LaunchError, match="asks for more slots than host 'localhost' has"):
        _plan(tmp_path, None, nproc_per_node=5)


def test_no_ssh_runs_one_node_of_the_layout(tmp_path: Path) -> None:
    plan = _plan(
        tmp_path,
        "a slots=2\nb slots=3\n",
        no_ssh=True,
        node_rank=1,
        master_addr="10.0.0.1",
        master_port=29999,
    )
    assert plan.backend == "no_ssh"
    envs = [dict(spec.shown_env) for spec in plan.specs]
    assert [e["RANK"] for e in envs] == ["2", "3", "4"]
    assert {
        (e["CROSS_RANK"], e["CROSS_SIZE"], e["WORLD_SIZE"], e["MASTER_ADDR"]) for e in envs
    } == {("1", "2", "5", "10.0.0.1")}
    with pytest.raises(LaunchError, match=r"--no_ssh needs --node_rank in 0\.\.1"):
        _plan(tmp_path, "a slots=2\nb slots=3\n", no_ssh=True, node_rank=2)


@pytest.mark.parametrize(
    ("hostfile", "options", "message"),
    [
        (
            "localhost slots=1\nworker-1 slots=1\n",
            {},
            "which other nodes cannot reach; pass --master_addr",
        ),
        (
            THREE_HOSTS,
            {"master_port": 0},
            "--master_port 0 asks for a free port, but rank 0 runs on 'worker-0'",
        ),
        (None, {"launcher": "ssh"}, "--launcher ssh needs a hostfile"),
        (THREE_HOSTS, {"num_gpus": 2, "nproc_per_node": 3}, "disagree"),
        (
            THREE_HOSTS,
            {"run": {"script": "t", "module": True, "no_python": True}},
            "cannot be combined",
        ),
    ],
    ids=[
        "loopback-master",
        "free-port-remote",
        "ssh-without-hostfile",
        "two-counts",
        "module-no-python",
    ],
)
def test_plan_errors(
    tmp_path: Path, hostfile: str | None, options: dict[str, Any], message: str
) -> None:
    with pytest.raises(LaunchError) as caught:
        _plan(tmp_path, hostfile, **options)
    assert message in str(caught.value)


def test_explicit_missing_hostfile_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(LaunchError, match="does not exist"):
        _plan(tmp_path, None, hostfile=str(tmp_path / "nope"))
