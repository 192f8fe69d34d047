"""Reading rank, world and rendezvous from torchrun, Open MPI and SLURM variables."""

from __future__ import annotations

from datetime import timedelta

import pytest

from deepshard.comm._launch_env import (
    DEFAULT_MASTER_PORT,
    DEFAULT_TIMEOUT,
    LaunchEnv,
    parse_hostlist,
    parse_tasks_per_node,
    read_launch_env,
    rendezvous_address,
    resolve_timeout,
)
from deepshard.interface.errors import CommError, ConfigError

TORCHRUN = {
    "RANK": "5",
    "WORLD_SIZE": "8",
    "LOCAL_RANK": "1",
    "LOCAL_WORLD_SIZE": "4",
    "MASTER_ADDR": "10.0.0.7",
    "MASTER_PORT": "29611",
}
OMPI = {
    "OMPI_COMM_WORLD_RANK": "3",
    "OMPI_COMM_WORLD_SIZE": "4",
    "OMPI_COMM_WORLD_LOCAL_RANK": "1",
    "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
}
SLURM = {
    "SLURM_PROCID": "6",
    "SLURM_NTASKS": "7",
    "SLURM_LOCALID": "0",
    "SLURM_NODEID": "3",
    "SLURM_STEP_TASKS_PER_NODE": "2(x3),1",
    "SLURM_STEP_NODELIST": "gpu[07-09],login2",
    "SLURM_JOB_NODELIST": "other[1-4]",
}


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        (TORCHRUN, LaunchEnv(5, 8, 1, 4, "10.0.0.7", 29611, "torchrun")),
        (
            {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"},
            LaunchEnv(1, 2, 1, 2, "h", 1, "torchrun"),
        ),
        (OMPI, LaunchEnv(3, 4, 1, 2, None, None, "openmpi")),
        (
            {**OMPI, "MASTER_ADDR": "head", "MASTER_PORT": "1234"},
            LaunchEnv(3, 4, 1, 2, "head", 1234, "openmpi"),
        ),
        (SLURM, LaunchEnv(6, 7, 0, 1, "gpu07", None, "slurm")),
        (
            {**SLURM, "SLURM_NODEID": "0", "SLURM_PROCID": "1", "SLURM_LOCALID": "1"},
            LaunchEnv(1, 7, 1, 2, "gpu07", None, "slurm"),
        ),
        (
            {k: v for k, v in SLURM.items() if k != "SLURM_STEP_NODELIST"},
            LaunchEnv(6, 7, 0, 1, "other1", None, "slurm"),
        ),
        ({**SLURM, "MASTER_ADDR": "explicit"}, LaunchEnv(6, 7, 0, 1, "explicit", None, "slurm")),
        (
            {
                "SLURM_PROCID": "0",
                "SLURM_STEP_NUM_TASKS": "2",
                "SLURM_LOCALID": "0",
                "SLURM_NODELIST": "n1",
            },
            LaunchEnv(0, 2, 0, 2, "n1", None, "slurm"),
        ),
        # The step's task count wins over the job's (srun -n 4 inside an 8-task job).
        (
            {**SLURM, "SLURM_NTASKS": "8", "SLURM_STEP_NUM_TASKS": "7"},
            LaunchEnv(6, 7, 0, 1, "gpu07", None, "slurm"),
        ),
        # MASTER_PORT defaults to one derived from the job id; an explicit one wins.
        ({**SLURM, "SLURM_JOB_ID": "123456"}, LaunchEnv(6, 7, 0, 1, "gpu07", 13456, "slurm")),
        ({**SLURM, "SLURM_JOB_ID": "7"}, LaunchEnv(6, 7, 0, 1, "gpu07", 10007, "slurm")),
        (
            {**SLURM, "SLURM_JOB_ID": "7", "MASTER_PORT": "2222"},
            LaunchEnv(6, 7, 0, 1, "gpu07", 2222, "slurm"),
        ),
        # python run directly in an sbatch script (the batch step): no srun step variables,
        # so not a SLURM rank but a world of one, whatever the job's SLURM_NTASKS says.
        (
            {
                "SLURM_PROCID": "0",
                "SLURM_NTASKS": "8",
                "SLURM_LOCALID": "0",
                "SLURM_NODEID": "0",
                "SLURM_TASKS_PER_NODE": "4(x2)",
                "SLURM_JOB_NODELIST": "n[1-2]",
                "SLURM_JOB_ID": "99",
            },
            LaunchEnv(0, 1, 0, 1, None, None, "none"),
        ),
        (
            {k: v for k, v in SLURM.items() if k != "SLURM_STEP_TASKS_PER_NODE"},
            LaunchEnv(0, 1, 0, 1, None, None, "none"),
        ),
        # torchrun's variables win over the SLURM job it runs in.
        ({**SLURM, **TORCHRUN}, LaunchEnv(5, 8, 1, 4, "10.0.0.7", 29611, "torchrun")),
        ({**SLURM, **OMPI}, LaunchEnv(3, 4, 1, 2, None, None, "openmpi")),
        ({}, LaunchEnv(0, 1, 0, 1, None, None, "none")),
        ({"PATH": "/bin"}, LaunchEnv(0, 1, 0, 1, None, None, "none")),
    ],
)
def test_launcher_variables_are_read(env: dict[str, str], expected: LaunchEnv) -> None:
    assert read_launch_env(env) == expected


@pytest.mark.parametrize(
    ("env", "named"),
    [
        ({"RANK": "0"}, "WORLD_SIZE"),
        ({"WORLD_SIZE": "2"}, "RANK"),
        ({"RANK": "x", "WORLD_SIZE": "2"}, "RANK"),
        ({"RANK": "0", "WORLD_SIZE": "0"}, "WORLD_SIZE"),
        ({"RANK": "-1", "WORLD_SIZE": "2"}, "RANK"),
        ({"RANK": "2", "WORLD_SIZE": "2"}, "RANK"),
        ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "2.5"}, "LOCAL_RANK"),
        ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "3"}, "LOCAL_RANK"),
        ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "70000"}, "MASTER_PORT"),
        ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "port"}, "MASTER_PORT"),
        (
            {k: v for k, v in OMPI.items() if k != "OMPI_COMM_WORLD_LOCAL_SIZE"},
            "OMPI_COMM_WORLD_LOCAL_SIZE",
        ),
        ({**OMPI, "OMPI_COMM_WORLD_SIZE": "four"}, "OMPI_COMM_WORLD_SIZE"),
        ({**SLURM, "SLURM_STEP_NUM_TASKS": "6"}, "SLURM_PROCID"),
        ({**SLURM, "SLURM_STEP_NUM_TASKS": "0"}, "SLURM_STEP_NUM_TASKS"),
        ({**SLURM, "SLURM_JOB_ID": "job"}, "SLURM_JOB_ID"),
        ({k: v for k, v in SLURM.items() if k != "SLURM_LOCALID"}, "SLURM_LOCALID"),
        ({**SLURM, "SLURM_STEP_TASKS_PER_NODE": "2(x)"}, "SLURM_STEP_TASKS_PER_NODE"),
        ({**SLURM, "SLURM_NODEID": "4"}, "SLURM_NODEID"),
        ({**SLURM, "SLURM_STEP_NODELIST": "gpu[07-09"}, "SLURM_STEP_NODELIST"),
    ],
)
def test_bad_launcher_variables_name_the_variable(env: dict[str, str], named: str) -> None:
    with pytest.raises(ConfigError, match=named):
        read_launch_env(env)


@pytest.mark.parametrize(
    ("expr", "hosts"),
    [
        ("node1", ["node1"]),
        ("a,b", ["a", "b"]),
        ("node[01-03,07]", ["node01", "node02", "node03", "node07"]),
        ("node[01-03,07],gpu-[1-2]", ["node01", "node02", "node03", "node07", "gpu-1", "gpu-2"]),
        ("n[8-11]", ["n8", "n9", "n10", "n11"]),
        ("n[08-11]", ["n08", "n09", "n10", "n11"]),
        ("n[098-100]", ["n098", "n099", "n100"]),
        ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),
        ("n[1-2]-ib", ["n1-ib", "n2-ib"]),
        ("n[5]", ["n5"]),
        ("login,c[1,3]", ["login", "c1", "c3"]),
        (" host.example.org ", ["host.example.org"]),
    ],
)
def test_slurm_hostlists_expand(expr: str, hosts: list[str]) -> None:
    assert parse_hostlist(expr) == hosts


@pytest.mark.parametrize(
    "expr", ["", "a,,b", "n[1-2", "n1-2]", "n[[1]]", "n[3-1]", "n[a-b]", "n[]", "n[1-]"]
)
def test_malformed_hostlists_are_rejected(expr: str) -> None:
    with pytest.raises(ConfigError, match="SLURM_JOB_NODELIST"):
        parse_hostlist(expr, variable="SLURM_JOB_NODELIST")


@pytest.mark.parametrize(
    ("expr", "counts"),
    [("4", [4]), ("2(x3),1", [2, 2, 2, 1]), ("1,3(x2)", [1, 3, 3]), (" 8(x1) ", [8])],
)
def test_tasks_per_node_expands(expr: str, counts: list[int]) -> None:
    assert parse_tasks_per_node(expr) == counts


@pytest.mark.parametrize("expr", ["", "x", "0", "2(x0)", "2(3)", "2(x3)1"])
def test_malformed_tasks_per_node_is_rejected(expr: str) -> None:
    with pytest.raises(ConfigError, match="SLURM_TASKS_PER_NODE"):
        parse_tasks_per_node(expr)


def test_rendezvous_defaults_to_localhost_on_one_node() -> None:
    assert rendezvous_address(LaunchEnv(1, 2, 1, 2, None, None, "torchrun")) == (
        "127.0.0.1",
        DEFAULT_MASTER_PORT,
    )
    assert rendezvous_address(LaunchEnv(1, 4, 1, 2, "head", 7, "openmpi")) == ("head", 7)


def test_rendezvous_across_nodes_needs_master_addr() -> None:
    with pytest.raises(ConfigError, match="MASTER_ADDR"):
        rendezvous_address(LaunchEnv(3, 4, 1, 2, None, None, "openmpi"))


def test_world_of_one_gets_a_free_port() -> None:
    import socket

    addr, port = rendezvous_address(LaunchEnv(0, 1, 0, 1, None, None, "none"))
    assert addr == "127.0.0.1"
    assert 0 < port < 65536
    with socket.socket() as probe:  # the port is free: it can be bound again
        probe.bind((addr, port))


def test_world_of_one_with_a_remote_master_addr_is_refused() -> None:
    # 192.0.2.1 is TEST-NET-1 (RFC 5737): never an address of this host.
    with pytest.raises(CommError, match="MASTER_ADDR"):
        rendezvous_address(LaunchEnv(0, 1, 0, 1, "192.0.2.1", None, "none"))
    # With MASTER_PORT given nothing is bound here, so the pair is passed through.
    assert rendezvous_address(LaunchEnv(0, 1, 0, 1, "192.0.2.1", 7, "none")) == ("192.0.2.1", 7)


@pytest.mark.parametrize(
    ("timeout", "env", "expected"),
    [
        (None, {}, DEFAULT_TIMEOUT),
        (None, {"DEEPSHARD_TIMEOUT": "3"}, timedelta(minutes=3)),
        (None, {"DEEPSHARD_TIMEOUT": "0.5"}, timedelta(seconds=30)),
        (None, {"DEEPSHARD_TIMEOUT": " "}, DEFAULT_TIMEOUT),
        (timedelta(seconds=7), {"DEEPSHARD_TIMEOUT": "3"}, timedelta(seconds=7)),
    ],
)
def test_timeout_precedence(
    timeout: timedelta | None, env: dict[str, str], expected: timedelta
) -> None:
    assert resolve_timeout(timeout, env) == expected


def test_default_timeout_is_ten_minutes() -> None:
    assert timedelta(minutes=10) == DEFAULT_TIMEOUT


@pytest.mark.parametrize("raw", ["ten", "0", "-1", "nan", "inf"])
def test_bad_deepshard_timeout_is_named(raw: str) -> None:
    with pytest.raises(ConfigError, match="DEEPSHARD_TIMEOUT"):
        resolve_timeout(None, {"DEEPSHARD_TIMEOUT": raw})


@pytest.mark.parametrize("timeout", [timedelta(0), timedelta(seconds=-1), 30])
def test_bad_timeout_argument_is_rejected(timeout: object) -> None:
    with pytest.raises(ConfigError, match="timeout"):
        resolve_timeout(timeout, {})  # type: ignore[arg-type]
