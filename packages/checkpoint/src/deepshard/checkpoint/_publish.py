"""Making a written checkpoint visible atomically, and retiring old ones.

The order is what makes a crash harmless: every file is fsynced, then the temporary directory
(so its entries are durable), then it is renamed to ``<tag>`` and the parent fsynced, and only
then is ``latest`` replaced, by writing a temporary file, fsyncing it and ``os.replace``-ing it
over ``latest`` (atomic on POSIX), then fsyncing the parent again. A crash before the rename
leaves a hidden ``.tmp-*`` directory that no reader looks at; a crash between the rename and
``latest`` leaves a complete new tag that ``latest`` does not name yet.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

from deepshard.checkpoint._layout import LATEST, TMP_PREFIX, list_tags, read_latest
from deepshard.interface.errors import CheckpointError

__all__ = [
    "fsync_dir",
    "prune",
    "publish",
    "remove_tree",
    "write_json_atomic",
    "write_latest",
]


def fsync_dir(path: Path) -> None:
    """Make the entries of directory ``path`` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json_atomic(path: Path, data: Any) -> None:
    """Write ``data`` as JSON to ``path`` through a fsynced temporary file and a rename."""
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}")
    with open(tmp, "x", encoding="utf-8") as handle:
        json.dump(data, handle, indent=1, allow_nan=False)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def publish(tmp_dir: Path, save_dir: Path, tag: str) -> Path:
    """Rename the complete ``tmp_dir`` to ``save_dir/tag``, replacing an older save of it."""
    fsync_dir(tmp_dir)
    final = save_dir / tag
    trash = None
    if final.exists():
        trash = save_dir / f"{TMP_PREFIX}old-{tag}-{uuid.uuid4().hex[:8]}"
        os.replace(final, trash)
    os.replace(tmp_dir, final)
    fsync_dir(save_dir)
    if trash is not None:
        shutil.rmtree(trash, ignore_errors=True)
    return final


def write_latest(save_dir: Path, tag: str) -> None:
    """Point ``latest`` at ``tag`` atomically."""
    tmp = save_dir / f".{LATEST}.{uuid.uuid4().hex}"
    with open(tmp, "x", encoding="utf-8") as handle:
        handle.write(tag + "\n")
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, save_dir / LATEST)
    fsync_dir(save_dir)


def remove_tree(path: Path) -> None:
    """Delete a directory a crashed or finished save left behind."""
    shutil.rmtree(path, ignore_errors=True)


def prune(save_dir: Path, keep_last: int) -> list[str]:
    """Delete all but the newest ``keep_last`` complete tags; return the deleted ones.

    The tag ``latest`` names is always kept, so is the newest complete one, so a retention
    setting can never delete the only complete checkpoint.
    """
    if isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1:
        raise CheckpointError(
            f"keep_last={keep_last!r} must be an int >= 1 (None keeps every checkpoint)"
        )
    tags = list_tags(save_dir)
    keep = set(tags[-keep_last:])
    latest = read_latest(save_dir)
    if latest is not None:
        keep.add(latest)
    deleted = [tag for tag in tags if tag not in keep]
    for tag in deleted:
        # Renamed away first, so a crash mid-delete leaves a hidden directory, not a damaged tag.
        doomed = save_dir / f"{TMP_PREFIX}del-{tag}-{uuid.uuid4().hex[:8]}"
        os.replace(save_dir / tag, doomed)
        shutil.rmtree(doomed, ignore_errors=True)
    if deleted:
        fsync_dir(save_dir)
    return deleted
