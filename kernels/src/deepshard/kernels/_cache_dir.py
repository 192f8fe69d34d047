"""Where Triton keeps the kernels it compiles, and whether that folder is on a network filesystem.

Triton compiles a kernel at its first launch and stores the result in its cache folder
(``TRITON_CACHE_DIR``, else ``$TRITON_HOME/.triton/cache``, else ``~/.triton/cache``). On a
cluster the home folder is often NFS (or Lustre, GPFS, ...): every rank of every node then
compiles into, locks and reads the same shared folder, which is slow and, with some NFS locking
setups, stalls a process at exit. DeepShard cannot fix the filesystem, but it can say so: the
first time its Triton kernels load, `warn_if_network_cache` looks the folder up and warns once,
naming the folder, its filesystem and the fix (point ``TRITON_CACHE_DIR`` at a local disk).

Finding a folder's filesystem:

1. The folder may not exist yet (Triton creates it on first use): its nearest existing
   ancestor is looked up instead, which is where it will be created.
2. On Linux, ``/proc/self/mountinfo`` lists every mount this process sees. The mount holding a
   path is the one whose mount point is the longest prefix of the path's real path (the last
   one listed wins a tie: a later mount on the same point hides the earlier). Its filesystem
   type follows the ``-`` separator. Mount points escape spaces and other characters as octal
   (``\\040``), which is undone before comparing. No process is started.
3. Elsewhere (no mountinfo) ``df -PT <path>`` is run and parsed. The parse does not count
   columns from the left, since a device name can be long enough to be printed on a line of
   its own (without ``-P``) or contain spaces (a CIFS share): it joins everything after the
   header and anchors on the capacity column (``NN%``), whose four predecessors are the type
   and the three block counts. A missing ``df``, a failing one or output of another shape
   gives "unknown", which never warns.
"""

from __future__ import annotations

import functools
import os
import re
import subprocess
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path

__all__ = [
    "NETWORK_FILESYSTEMS",
    "filesystem_type",
    "is_network_filesystem",
    "parse_df",
    "parse_mountinfo",
    "triton_cache_dir",
    "warn_if_network_cache",
]

NETWORK_FILESYSTEMS = frozenset(
    {
        "nfs", "nfs4", "cifs", "smb3", "smbfs", "lustre", "gpfs", "beegfs", "ceph", "glusterfs",
        "afs", "ncpfs", "panfs", "wekafs", "9p", "davfs", "fuse.sshfs", "fuse.glusterfs",
        "fuse.ceph", "fuse.s3fs", "fuse.gcsfuse", "fuse.juicefs", "fuse.lustre",
    }
)  # fmt: skip
"""Filesystem types (as mountinfo and ``df -T`` name them) that live on another machine."""

_CAPACITY = re.compile(r"\d+%|-")
_OCTAL = re.compile(r"\\([0-7]{3})")

Runner = Callable[[list[str]], str]
"""Runs a command and returns its standard output; raises ``OSError`` or
``subprocess.SubprocessError`` when it cannot."""


def triton_cache_dir(env: Mapping[str, str] | None = None) -> Path:
    """The folder Triton compiles into, read from ``env`` (the process environment) as Triton
    does: ``TRITON_CACHE_DIR``, else ``$TRITON_HOME/.triton/cache``, else ``~/.triton/cache``."""
    env = os.environ if env is None else env
    if env.get("TRITON_CACHE_DIR"):
        return Path(env["TRITON_CACHE_DIR"]).expanduser()
    home = env.get("TRITON_HOME") or os.path.expanduser("~")
    return Path(home).expanduser() / ".triton" / "cache"


def is_network_filesystem(fstype: str | None) -> bool:
    """Whether a filesystem type names a network filesystem (`NETWORK_FILESYSTEMS`)."""
    if not fstype:
        return False
    kind = fstype.lower()
    return kind in NETWORK_FILESYSTEMS or kind.startswith("nfs")


def _unescape(field: str) -> str:
    return _OCTAL.sub(lambda found: chr(int(found.group(1), 8)), field)


def _under(path: str, mount_point: str) -> bool:
    return mount_point == "/" or path == mount_point or path.startswith(mount_point + "/")


def parse_mountinfo(text: str, path: str) -> str | None:
    """The filesystem type of the mount holding ``path`` (absolute, resolved), from the text
    of ``/proc/self/mountinfo``; ``None`` when no line covers it."""
    best: tuple[int, str] | None = None
    for line in text.splitlines():
        fields = line.split()
        if "-" not in fields or len(fields) < 5:
            continue
        separator = fields.index("-")
        if separator + 1 >= len(fields):
            continue
        mount_point = _unescape(fields[4])
        if _under(path, mount_point) and (best is None or len(mount_point) >= best[0]):
            best = (len(mount_point), fields[separator + 1])
    return None if best is None else best[1]


def parse_df(output: str) -> str | None:
    """The filesystem type in the output of ``df -PT <path>`` (or ``df -T``), else ``None``."""
    lines = output.strip().splitlines()
    if len(lines) < 2 or "type" not in lines[0].lower():
        return None
    tokens = " ".join(lines[1:]).split()
    for at, token in enumerate(tokens):
        if at >= 5 and _CAPACITY.fullmatch(token):
            counts = tokens[at - 3 : at]
            if all(count.isdigit() or count == "-" for count in counts):
                return tokens[at - 4]
    return None


def _existing_ancestor(path: Path) -> Path:
    path = Path(os.path.abspath(path))
    while not path.exists() and path.parent != path:
        path = path.parent
    return path


def _run(command: list[str]) -> str:
    done = subprocess.run(command, capture_output=True, text=True, timeout=10, check=True)
    return done.stdout


def filesystem_type(
    path: Path,
    *,
    mountinfo: Path = Path("/proc/self/mountinfo"),
    run: Runner = _run,
) -> str | None:
    """The type of the filesystem ``path`` is (or would be created) on; ``None`` if unknown.

    Args:
        path: A file or folder, existing or not.
        mountinfo: The mount table to read (Linux); ``df -PT`` is run where it cannot be read.
        run: How ``df`` is run (a test passes its own).
    """
    where = os.path.realpath(_existing_ancestor(path))
    try:
        return parse_mountinfo(mountinfo.read_text(), where)
    except OSError:
        pass
    try:
        return parse_df(run(["df", "-PT", where]))
    except (OSError, subprocess.SubprocessError):
        return None


@functools.cache
def _warn_once(folder: str, fstype: str) -> None:
    warnings.warn(
        f"Triton's kernel cache {folder} is on a network filesystem ({fstype}): compiling and "
        "reading kernels there is slow when many ranks share it, and with some NFS setups a "
        "process can stall at exit; set TRITON_CACHE_DIR to a folder on a local disk "
        "(e.g. /tmp/triton-cache)",
        RuntimeWarning,
        stacklevel=3,
    )


def warn_if_network_cache(
    env: Mapping[str, str] | None = None,
    *,
    lookup: Callable[[Path], str | None] = filesystem_type,
) -> str | None:
    """Warn (once per folder and process) when Triton's cache folder is on a network filesystem.

    Args:
        env: The environment to read the folder from (`triton_cache_dir`); the process's own.
        lookup: How the folder's filesystem type is found (`filesystem_type`).

    Returns:
        The folder's filesystem type, or ``None`` if it could not be found.
    """
    folder = triton_cache_dir(env)
    fstype = lookup(folder)
    if fstype is not None and is_network_filesystem(fstype):
        _warn_once(str(folder), fstype)
    return fstype
