"""Starting a child so that it can always be cleaned up, and signalling its process group.

Every child the launcher starts (a rank, or the ssh/srun/mpirun client of a node) gets its own
session, hence its own process group: a terminal's Ctrl-C reaches only ``ds-launch``, which
decides what the children receive, and ``killpg`` reaches the child together with every process
it spawned that stayed in its group (data-loader workers, compiler subprocesses).

On Linux the child also asks the kernel for ``SIGKILL`` when its parent dies
(``prctl(PR_SET_PDEATHSIG)``, set through ctypes between ``fork`` and ``exec``), so a
``kill -9`` of the launcher does not leave ranks running. If the parent died before the
``prctl`` took effect, the child kills itself at once. Processes a rank starts in a session of
their own are beyond the reach of both mechanisms.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from collections.abc import Callable, Collection

__all__ = ["child_setup", "group_alive", "signal_group"]

_PR_SET_PDEATHSIG = 1


def child_setup(cpus: Collection[int] | None = None) -> Callable[[], None]:
    """A ``preexec_fn`` that ties the child's life to this process and optionally pins it.

    Built in the parent, so the child only calls functions already resolved (no import or
    library loading after ``fork``). Use together with ``start_new_session=True``.

    Args:
        cpus: Logical CPUs to pin the child to (``sched_setaffinity``), or ``None``.

    Returns:
        The function to pass as ``preexec_fn``.
    """
    parent = os.getpid()
    prctl = ctypes.CDLL(None, use_errno=True).prctl if sys.platform.startswith("linux") else None
    affinity = frozenset(cpus) if cpus is not None else None
    set_affinity = getattr(os, "sched_setaffinity", None)

    def setup() -> None:
        if prctl is not None:
            prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
            if os.getppid() != parent:  # the parent died before the request took effect
                os.kill(os.getpid(), signal.SIGKILL)
        if affinity is not None and set_affinity is not None:
            set_affinity(0, affinity)

    return setup


def signal_group(pgid: int, signum: int) -> bool:
    """Send ``signum`` to process group ``pgid``; ``False`` if the group no longer exists."""
    try:
        os.killpg(pgid, signum)
    except ProcessLookupError:
        return False
    except PermissionError:  # the id was reused by someone else's group: not ours any more
        return False
    return True


def _live_member_in_proc(pgid: int) -> bool:
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as handle:
                stat = handle.read()
        except OSError:  # exited while we looked
            continue
        # "pid (comm) state ppid pgrp ...": comm may hold spaces or ')', so split after the last.
        fields = stat[stat.rfind(b")") + 2 :].split()
        if len(fields) > 2 and int(fields[2]) == pgid and fields[0] not in (b"Z", b"X"):
            return True
    return False


def group_alive(pgid: int) -> bool:
    """Whether any process that is not a zombie is left in group ``pgid``.

    Zombies are ignored (on Linux, through ``/proc``): an orphan's zombie waits for whoever
    reaps orphans on this machine and can neither run nor be killed.
    """
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    if os.path.isdir("/proc/self"):
        return _live_member_in_proc(pgid)
    return True
