"""Narrowing the hostfile's slots with ``--include``/``--exclude``/``--num_nodes``/``--num_gpus``.

A filter is DeepSpeed's ``NODE_SPEC[@NODE_SPEC ...]`` with ``NODE_SPEC = HOST[:SLOT[,SLOT ...]]``:
``worker-0:0,2@worker-1`` means slots 0 and 2 of worker-0 and every slot of worker-1. Filters
are checked against the slots the hosts really have (a slot is an index into the host's visible
accelerators, or a CPU rank on a host without any): an unknown host or a slot out of range is an
error that names it, never a silently smaller or larger job. The result keeps the hostfile's
host order, which fixes the global rank order.
"""

from __future__ import annotations

from collections.abc import Mapping

from deepshard.interface.errors import LaunchError

__all__ = ["parse_resource_spec", "resolve_resources"]


def _slot(text: str, item: str, flag: str) -> int:
    if not text.strip().isdigit():
        raise LaunchError(
            f"{flag} {item!r}: slot {text!r} is not a non-negative integer; write HOST:0,2"
        )
    return int(text)


def parse_resource_spec(spec: str, flag: str = "--include") -> dict[str, list[int] | None]:
    """Parse ``HOST[:SLOT,...][@HOST[:SLOT,...] ...]``.

    Args:
        spec: The filter text.
        flag: The option it came from, named in errors.

    Returns:
        ``{host: sorted slots}``, or ``{host: None}`` for a whole host. A host named twice has
        its slots merged (a whole-host mention wins).

    Raises:
        LaunchError: An empty host or slot, or a slot that is not a non-negative integer.
    """
    parsed: dict[str, list[int] | None] = {}
    for item in spec.split("@"):
        host, colon, slot_text = item.strip().partition(":")
        if not host:
            raise LaunchError(
                f"{flag} {spec!r}: empty host name in {item!r}; write HOST[:SLOT,...] items "
                "joined by '@', e.g. worker-0:0,2@worker-1"
            )
        slots = (
            sorted({_slot(text, item, flag) for text in slot_text.split(",")}) if colon else None
        )
        if host in parsed:
            previous = parsed[host]
            slots = None if previous is None or slots is None else sorted({*previous, *slots})
        parsed[host] = slots
    return parsed


def _check_against_pool(
    parsed: Mapping[str, list[int] | None], pool: Mapping[str, int], flag: str
) -> None:
    for host, slots in parsed.items():
        if host not in pool:
            raise LaunchError(
                f"{flag}: host {host!r} is not in the hostfile (it has {', '.join(pool)})"
            )
        count = pool[host]
        out_of_range = [slot for slot in slots or () if slot >= count]
        if out_of_range:
            raise LaunchError(
                f"{flag}: slot {out_of_range[0]} of host {host!r} does not exist; it has "
                f"{count} slot{'s' if count != 1 else ''} (0-{count - 1})"
            )


Parsed = Mapping[str, "list[int] | None"]


def _include(parsed: Parsed, pool: Mapping[str, int]) -> dict[str, list[int]]:
    chosen: dict[str, list[int]] = {}
    for host, count in pool.items():  # hostfile order, not filter order
        if host in parsed:
            slots = parsed[host]
            chosen[host] = list(range(count)) if slots is None else list(slots)
    return chosen


def _exclude(parsed: Parsed, pool: Mapping[str, int]) -> dict[str, list[int]]:
    remaining: dict[str, list[int]] = {}
    for host, count in pool.items():
        dropped = parsed.get(host, [])
        if host in parsed and dropped is None:
            continue
        slots = [slot for slot in range(count) if slot not in (dropped or ())]
        if slots:
            remaining[host] = slots
    if not remaining:
        raise LaunchError("--exclude removes every slot of every host; nothing is left to run")
    return remaining


def _first(
    resources: dict[str, list[int]], num_nodes: int | None, num_slots: int | None
) -> dict[str, list[int]]:
    if num_nodes is not None:
        if num_nodes < 1:
            raise LaunchError(f"--num_nodes must be at least 1, got {num_nodes}")
        if num_nodes > len(resources):
            raise LaunchError(
                f"--num_nodes {num_nodes} asks for more hosts than the {len(resources)} "
                f"available ({', '.join(resources)})"
            )
        resources = dict(list(resources.items())[:num_nodes])
    if num_slots is not None:
        if num_slots < 1:
            raise LaunchError(f"--num_gpus/--nproc_per_node must be at least 1, got {num_slots}")
        for host, slots in resources.items():
            if num_slots > len(slots):
                raise LaunchError(
                    f"--num_gpus/--nproc_per_node {num_slots} asks for more slots than host "
                    f"{host!r} has ({len(slots)})"
                )
        resources = {host: slots[:num_slots] for host, slots in resources.items()}
    return resources


def resolve_resources(
    pool: Mapping[str, int],
    *,
    include: str = "",
    exclude: str = "",
    num_nodes: int | None = None,
    num_slots: int | None = None,
) -> dict[str, list[int]]:
    """The slots a job runs on: the hostfile's pool narrowed by the user's filters.

    Args:
        pool: ``{host: slot count}`` in hostfile order (see `parse_hostfile`).
        include: ``--include`` filter; only these hosts/slots are used.
        exclude: ``--exclude`` filter; these hosts/slots are removed.
        num_nodes: ``--num_nodes``: keep the first N hosts.
        num_slots: ``--num_gpus``/``--nproc_per_node``: keep the first N slots of each host.

    Returns:
        ``{host: slot indices}`` in hostfile order, every host with at least one slot.

    Raises:
        LaunchError: Both filters at once, a count combined with a filter, an unknown host,
            an out-of-range slot, a count larger than what is available, or nothing left.
    """
    if include and exclude:
        raise LaunchError("--include and --exclude cannot be used together; pass only one")
    if (include or exclude) and (num_nodes is not None or num_slots is not None):
        flag = "--include" if include else "--exclude"
        raise LaunchError(
            f"{flag} cannot be combined with --num_nodes/--num_gpus/--nproc_per_node; "
            f"name the slots in {flag} instead"
        )
    if include:
        parsed = parse_resource_spec(include, "--include")
        _check_against_pool(parsed, pool, "--include")
        return _include(parsed, pool)
    if exclude:
        parsed = parse_resource_spec(exclude, "--exclude")
        _check_against_pool(parsed, pool, "--exclude")
        return _exclude(parsed, pool)
    return _first({host: list(range(count)) for host, count in pool.items()}, num_nodes, num_slots)
