"""Where a process sits in the world, read from the variables its launcher set.

Pure functions of a mapping (the environment), so every launcher's layout is testable without
starting processes. Three launchers are recognised, in this order (torchrun inside a SLURM job
sets its own variables, which must win):

1. torchrun / ``ds-launch``: ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``,
   ``MASTER_ADDR``, ``MASTER_PORT``.
2. Open MPI (``mpirun``): ``OMPI_COMM_WORLD_RANK``, ``..._SIZE``, ``..._LOCAL_RANK``,
   ``..._LOCAL_SIZE``; the rendezvous address comes from ``MASTER_ADDR``/``MASTER_PORT``.
3. SLURM (``srun``): only inside a job *step*, recognised by the step variables
   ``SLURM_STEP_NUM_TASKS`` / ``SLURM_STEP_TASKS_PER_NODE`` that srun sets. The world size is
   ``SLURM_STEP_NUM_TASKS`` (else the sum of ``SLURM_STEP_TASKS_PER_NODE``), the rank
   ``SLURM_PROCID``, the local rank ``SLURM_LOCALID``, the tasks on this node come from
   ``SLURM_STEP_TASKS_PER_NODE`` and ``SLURM_NODEID``; ``MASTER_ADDR`` defaults to the first
   host of the step's node list and ``MASTER_PORT`` to ``10000 + SLURM_JOB_ID % 20000``, so
   two jobs sharing a node do not collide. A python started directly in an ``sbatch`` script
   (the batch step: ``SLURM_PROCID=0`` and the job's ``SLURM_NTASKS``, but no step variables)
   is *not* a SLURM rank: it is a world of one, instead of waiting for peers that never come.

With none of them the process is a world of one. Defaults for the rendezvous, applied by
`rendezvous_address`: ``MASTER_ADDR`` is ``127.0.0.1`` when the whole world runs on one
node and is required otherwise; ``MASTER_PORT`` is 29500 (torchrun's default) for several
processes, or a free port for a world of one.
"""

from __future__ import annotations

import dataclasses
import itertools
import re
import socket
from collections.abc import Mapping
from datetime import timedelta
from typing import Literal

from deepshard.interface.errors import CommError, ConfigError

__all__ = [
    "DEFAULT_MASTER_PORT",
    "DEFAULT_TIMEOUT",
    "LaunchEnv",
    "parse_hostlist",
    "parse_tasks_per_node",
    "read_launch_env",
    "rendezvous_address",
    "resolve_timeout",
]

DEFAULT_MASTER_PORT = 29500
"""Rendezvous port when several processes start without ``MASTER_PORT`` (torchrun's default)."""
DEFAULT_TIMEOUT = timedelta(minutes=10)
"""Timeout of every process group unless ``DEEPSHARD_TIMEOUT`` or an argument says otherwise."""
TIMEOUT_ENV = "DEEPSHARD_TIMEOUT"

Launcher = Literal["torchrun", "openmpi", "slurm", "none"]


@dataclasses.dataclass(frozen=True)
class LaunchEnv:
    """This process's place in the world as the launcher described it.

    Attributes:
        rank: Global rank.
        world_size: Number of processes.
        local_rank: Rank among the processes on this node.
        local_world_size: Number of processes on this node.
        master_addr: Rendezvous host, ``None`` if the launcher gave none.
        master_port: Rendezvous port, ``None`` if the launcher gave none.
        launcher: Which set of variables was read.
    """

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str | None
    master_port: int | None
    launcher: Launcher


def _int(env: Mapping[str, str], name: str, *, minimum: int = 0) -> int:
    if name not in env:
        raise ConfigError(f"environment variable {name} is not set; the launcher must set it")
    raw = env[name].strip()
    try:
        value = int(raw)
    except ValueError:
        raise ConfigError(f"environment variable {name}={env[name]!r} is not an integer") from None
    if value < minimum:
        raise ConfigError(f"environment variable {name}={value} must be >= {minimum}")
    return value


def _optional_int(env: Mapping[str, str], name: str, default: int) -> int:
    return _int(env, name) if name in env else default


def _port(env: Mapping[str, str]) -> int | None:
    if "MASTER_PORT" not in env:
        return None
    port = _int(env, "MASTER_PORT", minimum=1)
    if port > 65535:
        raise ConfigError(f"environment variable MASTER_PORT={port} is not a port (1-65535)")
    return port


def _addr(env: Mapping[str, str]) -> str | None:
    addr = env.get("MASTER_ADDR", "").strip()
    return addr or None


def _check_place(rank: int, world: int, local_rank: int, local_world: int, names: str) -> None:
    if rank >= world:
        raise ConfigError(f"{names}: rank {rank} is not below the world size {world}")
    if local_rank >= local_world or local_world > world:
        raise ConfigError(
            f"{names}: local rank {local_rank} of {local_world} local processes does not fit "
            f"a world of {world}"
        )


def _from_torchrun(env: Mapping[str, str]) -> LaunchEnv:
    rank = _int(env, "RANK")
    world = _int(env, "WORLD_SIZE", minimum=1)
    # Without the local variables, assume every process runs on this node.
    local_rank = _optional_int(env, "LOCAL_RANK", rank)
    local_world = _optional_int(env, "LOCAL_WORLD_SIZE", world)
    _check_place(rank, world, local_rank, local_world, "RANK/WORLD_SIZE/LOCAL_RANK")
    return LaunchEnv(rank, world, local_rank, local_world, _addr(env), _port(env), "torchrun")


def _from_openmpi(env: Mapping[str, str]) -> LaunchEnv:
    rank = _int(env, "OMPI_COMM_WORLD_RANK")
    world = _int(env, "OMPI_COMM_WORLD_SIZE", minimum=1)
    local_rank = _int(env, "OMPI_COMM_WORLD_LOCAL_RANK")
    local_world = _int(env, "OMPI_COMM_WORLD_LOCAL_SIZE", minimum=1)
    _check_place(rank, world, local_rank, local_world, "OMPI_COMM_WORLD_*")
    return LaunchEnv(rank, world, local_rank, local_world, _addr(env), _port(env), "openmpi")


_SLURM_STEP_VARIABLES = ("SLURM_STEP_NUM_TASKS", "SLURM_STEP_TASKS_PER_NODE")
_SLURM_PORT_BASE, _SLURM_PORT_SPAN = 10000, 20000


def _slurm_step_counts(env: Mapping[str, str]) -> list[int] | None:
    name = "SLURM_STEP_TASKS_PER_NODE"
    return parse_tasks_per_node(env[name], variable=name) if name in env else None


def _slurm_local_world(env: Mapping[str, str], counts: list[int] | None, world: int) -> int:
    if counts is None:  # srun gave the task count but not its layout: one node
        return world
    node = _optional_int(env, "SLURM_NODEID", 0)
    if node >= len(counts):
        raise ConfigError(
            f"SLURM_NODEID={node} but SLURM_STEP_TASKS_PER_NODE="
            f"{env['SLURM_STEP_TASKS_PER_NODE']!r} lists fewer nodes"
        )
    return counts[node]


def _slurm_port(env: Mapping[str, str]) -> int | None:
    """``MASTER_PORT`` if set, else one derived from ``SLURM_JOB_ID`` (unique per job)."""
    port = _port(env)
    if port is None and "SLURM_JOB_ID" in env:
        port = _SLURM_PORT_BASE + _int(env, "SLURM_JOB_ID") % _SLURM_PORT_SPAN
    return port


def _from_slurm(env: Mapping[str, str]) -> LaunchEnv:
    counts = _slurm_step_counts(env)
    if "SLURM_STEP_NUM_TASKS" in env or counts is None:
        world = _int(env, "SLURM_STEP_NUM_TASKS", minimum=1)
    else:
        world = sum(counts)
    rank = _int(env, "SLURM_PROCID")
    local_rank = _int(env, "SLURM_LOCALID")
    local_world = _slurm_local_world(env, counts, world)
    _check_place(
        rank, world, local_rank, local_world, "SLURM_PROCID/SLURM_STEP_NUM_TASKS/SLURM_LOCALID"
    )
    addr = _addr(env)
    if addr is None:
        for name in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"):
            if env.get(name, "").strip():
                addr = parse_hostlist(env[name], variable=name)[0]
                break
    return LaunchEnv(rank, world, local_rank, local_world, addr, _slurm_port(env), "slurm")


def read_launch_env(env: Mapping[str, str]) -> LaunchEnv:
    """Read this process's rank and rendezvous from the launcher's variables in ``env``.

    Raises:
        ConfigError: A variable is missing, not an integer or inconsistent (it is named).
    """
    if "RANK" in env or "WORLD_SIZE" in env:
        return _from_torchrun(env)
    if "OMPI_COMM_WORLD_RANK" in env:
        return _from_openmpi(env)
    if "SLURM_PROCID" in env and any(name in env for name in _SLURM_STEP_VARIABLES):
        return _from_slurm(env)
    # No launcher, or SLURM's batch step (the sbatch script itself): a world of one.
    return LaunchEnv(0, 1, 0, 1, _addr(env), _port(env), "none")


def _free_port(host: str) -> int:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.bind((host, 0))
            port: int = probe.getsockname()[1]
            return port
    except OSError as error:
        raise CommError(
            f"a world of one serves its own rendezvous, but MASTER_ADDR={host!r} is not an "
            f"address of this host ({error}); unset MASTER_ADDR, or set MASTER_PORT as well"
        ) from error


def rendezvous_address(launch: LaunchEnv) -> tuple[str, int]:
    """The (host, port) that rank 0 serves the rendezvous store on, defaults applied.

    Raises:
        ConfigError: Several nodes take part and no ``MASTER_ADDR`` is known.
        CommError: A world of one without ``MASTER_PORT`` whose ``MASTER_ADDR`` is not local.
    """
    addr = launch.master_addr
    if addr is None:
        if launch.local_world_size != launch.world_size:
            raise ConfigError(
                f"environment variable MASTER_ADDR is not set and the {launch.world_size} "
                f"processes span several nodes ({launch.local_world_size} on this one); "
                "set MASTER_ADDR to the host of rank 0"
            )
        addr = "127.0.0.1"
    port = launch.master_port
    if port is None:
        port = _free_port(addr) if launch.world_size == 1 else DEFAULT_MASTER_PORT
    return addr, port


def _split_top_level(expr: str, variable: str) -> list[str]:
    items, depth, start = [], 0, 0
    for i, char in enumerate(expr):
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
        if depth not in (0, 1):
            raise ConfigError(f"{variable}={expr!r}: unbalanced or nested brackets")
        if char == "," and depth == 0:
            items.append(expr[start:i])
            start = i + 1
    if depth != 0:
        raise ConfigError(f"{variable}={expr!r}: unbalanced brackets")
    items.append(expr[start:])
    return items


def _expand_range_list(body: str, expr: str, variable: str) -> list[str]:
    values: list[str] = []
    for part in body.split(","):
        low, dash, high = part.strip().partition("-")
        if not low.isdigit() or (dash and not high.isdigit()):
            raise ConfigError(f"{variable}={expr!r}: [{body}] must hold numbers or ranges a-b")
        if not dash:
            values.append(low)
            continue
        if int(high) < int(low):
            raise ConfigError(f"{variable}={expr!r}: range {part} runs backwards")
        # SLURM pads every number to the width of the range's lower bound: [08-10] is 08 09 10.
        values.extend(f"{n:0{len(low)}d}" for n in range(int(low), int(high) + 1))
    return values


def parse_hostlist(expr: str, *, variable: str = "hostlist") -> list[str]:
    """Expand a SLURM compressed host list such as ``node[01-03,07],gpu-[1-2]``.

    Items are separated by commas outside brackets; each bracket holds numbers and ranges
    (zero-padded to the lower bound's width); several brackets in one item multiply out
    (``r[1-2]n[1-2]`` is ``r1n1 r1n2 r2n1 r2n2``).

    Args:
        expr: The list, as in ``SLURM_JOB_NODELIST``.
        variable: The variable it came from, named in errors.

    Returns:
        The host names in order.

    Raises:
        ConfigError: Empty list, empty item, unbalanced brackets or a malformed range.
    """
    hosts: list[str] = []
    for item in _split_top_level(expr.strip(), variable):
        if not item:
            raise ConfigError(f"{variable}={expr!r}: empty host name")
        pieces = re.split(r"\[([^\[\]]*)\]", item)
        # re.split alternates literal text and bracket bodies: even indices are literal.
        choices = [
            [piece] if i % 2 == 0 else _expand_range_list(piece, expr, variable)
            for i, piece in enumerate(pieces)
        ]
        hosts.extend("".join(combo) for combo in itertools.product(*choices))
    return hosts


def parse_tasks_per_node(expr: str, *, variable: str = "SLURM_TASKS_PER_NODE") -> list[int]:
    """Expand SLURM's tasks-per-node list, e.g. ``2(x3),1`` is ``[2, 2, 2, 1]``.

    Raises:
        ConfigError: An item is not ``N`` or ``N(xK)`` with positive integers.
    """
    counts: list[int] = []
    for item in expr.split(","):
        match = re.fullmatch(r"\s*(\d+)\s*(?:\(x(\d+)\))?\s*", item)
        if match is None or int(match[1]) < 1 or (match[2] is not None and int(match[2]) < 1):
            raise ConfigError(f"{variable}={expr!r}: {item!r} is not N or N(xK)")
        counts.extend([int(match[1])] * int(match[2] or 1))
    return counts


def resolve_timeout(timeout: timedelta | None, env: Mapping[str, str]) -> timedelta:
    """The process-group timeout: the argument, else ``DEEPSHARD_TIMEOUT`` minutes, else 10 min.

    Raises:
        ConfigError: The argument is not a positive ``timedelta`` or the variable is not a
            positive number of minutes.
    """
    if timeout is not None:
        if not isinstance(timeout, timedelta) or timeout <= timedelta(0):
            raise ConfigError(f"timeout must be a positive datetime.timedelta, got {timeout!r}")
        return timeout
    raw = env.get(TIMEOUT_ENV)
    if raw is None or not raw.strip():
        return DEFAULT_TIMEOUT
    try:
        minutes = float(raw)
    except ValueError:
        minutes = float("nan")
    if not minutes > 0 or minutes == float("inf"):
        raise ConfigError(
            f"environment variable {TIMEOUT_ENV}={raw!r} must be a positive number of minutes"
        )
    return timedelta(minutes=minutes)
