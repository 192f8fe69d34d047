"""Splitting a node's CPU cores between its ranks.

The cores are those this process may run on (``os.sched_getaffinity``), grouped into physical
cores by ``/sys/devices/system/cpu/cpuN/topology/thread_siblings_list``: two ranks never share
the hyper-threads of one core. Each rank gets an equal, contiguous share of whole cores (the
remainder stays unused, as in DeepSpeed); with fewer physical cores than ranks the logical CPUs
are split instead. ``--bind_core_list 1,3-5`` replaces the detected cores with the user's
logical CPU ids, split the same way; as in DeepSpeed, its items must ascend without overlapping
(``8,2-6`` is refused rather than reordered: the order decides which rank gets which CPUs).

The share is used twice: ``OMP_NUM_THREADS`` (unless the user set it) is its number of cores,
and with ``--bind_cores_to_rank`` the rank is pinned to it with ``sched_setaffinity`` in the
child before ``exec`` (no numactl needed).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from deepshard.interface.errors import LaunchError

__all__ = ["available_cpus", "core_groups", "parse_core_list", "split_cores"]

SYSFS_CPU = "/sys/devices/system/cpu"


def parse_core_list(spec: str) -> list[int]:
    """Expand ``1,3-5,7`` into ``[1, 3, 4, 5, 7]``.

    Raises:
        LaunchError: An item is not ``N`` or ``A-B`` with ``A <= B``, or does not start after
            the previous item ends (items ascend and do not overlap).
    """
    cpus: list[int] = []
    for item in spec.split(","):
        low, dash, high = item.strip().partition("-")
        if not low.isdigit() or (dash and not high.isdigit()):
            raise LaunchError(
                f"--bind_core_list {spec!r}: {item!r} is not a CPU id or a range A-B "
                "(write e.g. 0-3,8-11)"
            )
        end = int(high) if dash else int(low)
        if end < int(low):
            raise LaunchError(f"--bind_core_list {spec!r}: range {item!r} runs backwards")
        if cpus and int(low) <= cpus[-1]:
            raise LaunchError(
                f"--bind_core_list {spec!r}: {item!r} does not come after CPU {cpus[-1]}; list "
                "the CPUs in ascending order without overlaps, e.g. 0-3,8-11"
            )
        cpus.extend(range(int(low), end + 1))
    return cpus


def available_cpus() -> list[int]:
    """The logical CPUs this process may run on, sorted."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def _siblings(cpu: int, sysfs: str) -> frozenset[int]:
    path = os.path.join(sysfs, f"cpu{cpu}", "topology", "thread_siblings_list")
    try:
        with open(path, encoding="ascii") as handle:
            return frozenset(parse_core_list(handle.read().strip()))
    except (OSError, LaunchError):
        return frozenset({cpu})


def core_groups(cpus: Sequence[int], sysfs: str = SYSFS_CPU) -> list[tuple[int, ...]]:
    """Group logical CPUs into physical cores (hyper-thread siblings together), in CPU order.

    Args:
        cpus: The logical CPUs to group; siblings outside this set are left out.
        sysfs: The ``/sys/devices/system/cpu`` directory (tests pass a fake one).

    Returns:
        One tuple of logical CPUs per physical core, ordered by their first CPU.
    """
    allowed = set(cpus)
    groups: dict[tuple[int, ...], None] = {}
    for cpu in sorted(allowed):
        group = tuple(sorted(_siblings(cpu, sysfs) & allowed)) or (cpu,)
        groups.setdefault(group, None)
    return sorted(groups, key=lambda group: group[0])


def _share(units: Sequence[tuple[int, ...]], ranks: int) -> list[tuple[int, ...]]:
    per_rank = len(units) // ranks
    return [
        tuple(sorted(cpu for unit in units[i * per_rank : (i + 1) * per_rank] for cpu in unit))
        for i in range(ranks)
    ]


def split_cores(
    ranks: int,
    *,
    core_list: Sequence[int] | None = None,
    cpus: Sequence[int] | None = None,
    sysfs: str = SYSFS_CPU,
) -> list[tuple[tuple[int, ...], int]]:
    """Give each of ``ranks`` local ranks an equal share of the cores.

    Args:
        ranks: Number of ranks on this node.
        core_list: The user's ``--bind_core_list`` (logical CPU ids), or ``None`` to use
            the physical cores of ``cpus``.
        cpus: The logical CPUs available (default: this process's affinity).
        sysfs: The ``/sys/devices/system/cpu`` directory.

    Returns:
        Per local rank: ``(logical CPUs to pin to, number of cores = OMP_NUM_THREADS)``.

    Raises:
        LaunchError: ``core_list`` names CPUs this process may not use, or there are fewer
            cores than ranks.
    """
    available = list(cpus) if cpus is not None else available_cpus()
    if core_list is not None:
        outside = sorted(set(core_list) - set(available))
        if outside:
            raise LaunchError(
                f"--bind_core_list names CPU {outside[0]}, which this process may not use "
                f"(available: {','.join(map(str, available))})"
            )
        if len(core_list) < ranks:
            raise LaunchError(
                f"--bind_core_list has {len(core_list)} CPUs for {ranks} ranks on this node; "
                "list at least one CPU per rank"
            )
        shares = _share([(cpu,) for cpu in core_list], ranks)
        return [(share, len(share)) for share in shares]
    groups = core_groups(available, sysfs)
    if len(groups) >= ranks:
        per_rank = len(groups) // ranks
        return [(share, per_rank) for share in _share(groups, ranks)]
    if len(available) >= ranks:
        shares = _share([(cpu,) for cpu in available], ranks)
        return [(share, len(share)) for share in shares]
    raise LaunchError(
        f"this node has {len(available)} CPUs for {ranks} ranks; binding needs at least one "
        "CPU per rank (start fewer ranks or drop --bind_cores_to_rank)"
    )
