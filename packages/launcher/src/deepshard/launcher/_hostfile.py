"""The hostfile: which hosts a job may use and how many slots (accelerators) each has.

The format is DeepSpeed's (and Open MPI's): one ``HOST slots=N`` per line, ``#`` starts a
comment (whole line or trailing), blank lines are skipped. Open MPI's ``max_slots=M`` may follow
(DeepSpeed calls its hostfile Open MPI compatible); it changes nothing here, since every slot
is a rank. Unlike DeepSpeed, anything else on a line is an error rather than silently ignored,
so a typo such as ``slot=4`` cannot turn into a smaller job. Host names may not contain ``@``,
``:`` or ``,``: those separate hosts and slots in ``--include``/``--exclude``.
"""

from __future__ import annotations

import os
import re

from deepshard.interface.errors import LaunchError

__all__ = ["DEFAULT_HOSTFILE", "parse_hostfile", "parse_hostfile_text"]

DEFAULT_HOSTFILE = "/job/hostfile"
"""Where ``ds-launch`` looks for a hostfile when ``--hostfile`` is not given (DeepSpeed's)."""

_LINE = re.compile(r"(?P<host>\S+)\s+slots\s*=\s*(?P<slots>\d+)(\s+max_slots\s*=\s*\d+)?")
_RESERVED = ("@", ":", ",")


def _check_host(host: str, where: str) -> None:
    bad = [char for char in _RESERVED if char in host]
    if bad:
        raise LaunchError(
            f"{where}: host name {host!r} contains {' '.join(repr(c) for c in bad)}, which "
            "--include/--exclude use as separators; use the plain host name (set the ssh user "
            "in ~/.ssh/config or pass it through --launcher_args)"
        )


def parse_hostfile_text(text: str, source: str = "<hostfile>") -> dict[str, int]:
    """Parse hostfile contents into ``{host: slot count}``, in file order.

    Args:
        text: The file's contents.
        source: Where the text came from, named in errors (``path:line``).

    Returns:
        The hosts in the order they appear, each with its number of slots (at least 1).

    Raises:
        LaunchError: A line is not ``HOST slots=N``, a host appears twice, a slot count is 0,
            or the file names no host at all.
    """
    hosts: dict[str, int] = {}
    first_seen: dict[str, int] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        where = f"{source}:{number}"
        match = _LINE.fullmatch(line)
        if match is None:
            raise LaunchError(
                f"{where}: {raw.strip()!r} is not a hostfile entry; write one 'HOST slots=N' "
                "per line (e.g. 'worker-0 slots=8'), '#' for comments"
            )
        host, slots = match["host"], int(match["slots"])
        _check_host(host, where)
        if host in hosts:
            raise LaunchError(
                f"{where}: host {host!r} is listed again (first on line {first_seen[host]}); "
                "list each host once with its total slot count"
            )
        if slots < 1:
            raise LaunchError(f"{where}: host {host!r} has slots={slots}; it must be at least 1")
        hosts[host] = slots
        first_seen[host] = number
    if not hosts:
        raise LaunchError(
            f"{source}: the hostfile names no host; add lines such as 'worker-0 slots=8', or "
            "remove the file (or pass no --hostfile) to launch on this machine only"
        )
    return hosts


def parse_hostfile(path: str | os.PathLike[str]) -> dict[str, int]:
    """Read and parse a hostfile (see `parse_hostfile_text`).

    Args:
        path: The hostfile.

    Returns:
        ``{host: slot count}`` in file order.

    Raises:
        LaunchError: The file cannot be read or is malformed (the message names file and line).
    """
    try:
        with open(path, encoding="utf-8") as handle:
            text = handle.read()
    except (OSError, UnicodeDecodeError) as error:
        raise LaunchError(f"cannot read hostfile {os.fspath(path)!r}: {error}") from error
    return parse_hostfile_text(text, os.fspath(path))
