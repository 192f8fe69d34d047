"""The on-disk layout: tag directories, ``latest``, the metadata file, and reading them back.

::

    save_dir/
      latest                      the tag of the newest complete checkpoint (one line)
      <tag>/
        metadata.json             format version, versions, the caller's metadata, files, maps
        rank-00000-of-00002.safetensors
        rank-00001-of-00002.safetensors   (or rank-00001-of-00002-part-00000.safetensors, ...
                                           when save(max_file_bytes=) splits a rank's data)
      .tmp-<tag>-<token>/         a save in progress (renamed to <tag> when complete)

A tag directory exists only once it is complete: saves write into a hidden temporary
directory and rename it. So every visible tag with a readable ``metadata.json`` is complete,
and ``latest`` names one of them.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from deepshard.interface.errors import CheckpointError

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "LATEST",
    "METADATA",
    "check_tag",
    "data_file_name",
    "list_tags",
    "read_latest",
    "read_metadata",
    "resolve_tag_dir",
]

FORMAT_NAME = "deepshard-checkpoint"
FORMAT_VERSION = 3
"""Version of ``metadata.json``; readers refuse a newer one. 1: a file's ``sha256`` is the
whole file's; 2: it is `digest_of_blocks` of its ``block_sha256``; 3: each file also lists the
XXH3-64 of its blocks (``block_xxh3``), which loads check (all three still load)."""
LATEST = "latest"
METADATA = "metadata.json"
TMP_PREFIX = ".tmp-"


def check_tag(tag: str) -> str:
    """Return ``tag`` if it can name a directory of its own, else raise `CheckpointError`."""
    if (
        not isinstance(tag, str)
        or not tag
        or tag.startswith(".")
        or tag == LATEST
        or any(c in tag for c in "/\\\0\n")
    ):
        raise CheckpointError(
            f"checkpoint tag {tag!r} must be a non-empty directory name without '/', not "
            f"starting with '.' and not {LATEST!r} (e.g. 'global_step100')"
        )
    return tag


def data_file_name(rank: int, world_size: int, part: int | None = None) -> str:
    """The safetensors file of ``rank`` (its ``part``-th when its data is split by size)."""
    if part is None:
        return f"rank-{rank:05d}-of-{world_size:05d}.safetensors"
    return f"rank-{rank:05d}-of-{world_size:05d}-part-{part:05d}.safetensors"


def read_latest(load_dir: Path) -> str | None:
    """The tag ``latest`` names, or ``None`` when there is no ``latest``."""
    try:
        text = (load_dir / LATEST).read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise CheckpointError(f"cannot read {load_dir / LATEST}: {exc}") from exc
    return check_tag(text)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as exc:
        raise CheckpointError(
            f"{path} is missing, so {path.parent} is not a complete checkpoint; load another "
            "tag (list_tags) or save again"
        ) from exc
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(
            f"{path} is unreadable or truncated ({exc}); the checkpoint is damaged: load "
            "another tag (list_tags) or restore the file"
        ) from exc
    if not isinstance(data, dict) or data.get("format") != FORMAT_NAME:
        raise CheckpointError(f"{path} is not a {FORMAT_NAME} metadata file")
    version = data.get("format_version")
    if not isinstance(version, int) or not 1 <= version <= FORMAT_VERSION:
        raise CheckpointError(
            f"{path} has format_version {version!r}; this deepshard-checkpoint reads up to "
            f"{FORMAT_VERSION}: upgrade it"
        )
    return data


def list_tags(load_dir: str | os.PathLike[str]) -> list[str]:
    """The complete checkpoints under ``load_dir``, oldest save first.

    A tag counts when its directory holds a readable ``metadata.json``; damaged or foreign
    directories are skipped.
    """
    root = Path(load_dir)
    if not root.is_dir():
        return []
    found: list[tuple[float, str]] = []
    for entry in root.iterdir():
        if entry.name.startswith(".") or not entry.is_dir():
            continue
        try:
            saved_at = float(_read_json(entry / METADATA).get("saved_at", 0.0))
        except CheckpointError:
            continue
        found.append((saved_at, entry.name))
    return [name for _, name in sorted(found)]


def resolve_tag_dir(load_dir: str | os.PathLike[str], tag: str | None) -> Path:
    """The directory of ``tag``, or of the tag ``latest`` names when ``tag`` is ``None``.

    Raises:
        CheckpointError: No such tag, or no tag and no ``latest``; the message lists the tags
            present.
    """
    root = Path(load_dir)
    if tag is None:
        tag = read_latest(root)
        if tag is None:
            raise CheckpointError(
                f"{root} has no {LATEST!r} file and no tag was given; pass tag= one of "
                f"{list_tags(root)}"
            )
    path = root / check_tag(tag)
    if not path.is_dir():
        raise CheckpointError(
            f"checkpoint tag {tag!r} is not in {root}; tags present: {list_tags(root)}"
        )
    return path


def read_metadata(load_dir: str | os.PathLike[str], tag: str | None = None) -> dict[str, Any]:
    """The parsed ``metadata.json`` of ``tag`` (``latest`` when ``None``).

    ``load_dir`` may also be a tag directory itself (one holding ``metadata.json``).
    """
    root = Path(load_dir)
    if tag is None and (root / METADATA).is_file():
        return _read_json(root / METADATA)
    return _read_json(resolve_tag_dir(root, tag) / METADATA)


def tag_dir_of(path_or_dir: str | os.PathLike[str], tag: str | None) -> Path:
    """A tag directory given either itself or its parent (with ``tag`` or ``latest``)."""
    root = Path(path_or_dir)
    if tag is None and (root / METADATA).is_file():
        return root
    return resolve_tag_dir(root, tag)
