"""``verify``: every file's size and digests, every tensor's coverage and entry sizes."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from safetensors import SafetensorError, safe_open

from deepshard.checkpoint._layout import read_metadata, tag_dir_of
from deepshard.checkpoint._load import check_file
from deepshard.interface import ShardMap
from deepshard.interface.errors import CheckpointError

__all__ = ["VerifyReport", "verify"]


@dataclass(frozen=True)
class VerifyReport:
    """What `verify` found.

    Attributes:
        path: The tag directory checked.
        files_checked: How many data files were hashed.
        tensors_checked: How many tensors' maps and entries were checked.
        problems: One line per problem, each naming the file or tensor; empty when sound.
    """

    path: Path
    files_checked: int
    tensors_checked: int
    problems: tuple[str, ...]

    @property
    def ok(self) -> bool:
        """Whether no problem was found."""
        return not self.problems


def _entry_sizes(tag_dir: Path, file: str) -> dict[str, int]:
    with safe_open(tag_dir / file, framework="pt") as handle:
        sizes = {}
        for key in handle.keys():  # noqa: SIM118 (a safe_open handle is not iterable)
            shape = handle.get_slice(key).get_shape()
            sizes[key] = 1 if not shape else int(shape[0])
        return sizes


def _check_tensor(name: str, entry: dict[str, Any], sizes: dict[str, dict[str, int]]) -> None:
    smap = ShardMap.from_json(entry["shard_map"])
    smap.validate_coverage()
    for rank, file in entry["files"].items():
        want = sum(p.numel for p in smap.pieces if p.rank == int(rank))
        have = sizes.get(file, {}).get(name)
        if have != want:
            raise CheckpointError(
                f"{name}: {file} holds {have} elements of it, its shard map says {want}"
            )


def verify(path: str | os.PathLike[str], tag: str | None = None) -> VerifyReport:
    """Check a checkpoint (a tag directory, or a checkpoint directory with ``tag``/``latest``).

    Never raises for a damaged checkpoint: the report lists what is wrong.
    """
    problems: list[str] = []
    try:
        tag_dir = tag_dir_of(path, tag)
        meta = read_metadata(tag_dir)
    except CheckpointError as exc:
        return VerifyReport(Path(path), 0, 0, (str(exc),))
    sizes: dict[str, dict[str, int]] = {}
    for file, expected in sorted(meta["files"].items()):
        try:
            check_file(tag_dir / file, expected, checksum=True, version=int(meta["format_version"]))
            sizes[file] = _entry_sizes(tag_dir, file)
        except (CheckpointError, SafetensorError, OSError) as exc:
            problems.append(str(exc))
    for name, entry in sorted(meta["tensors"].items()):
        try:
            _check_tensor(name, entry, sizes)
        except CheckpointError as exc:
            problems.append(f"{name}: {exc}" if not str(exc).startswith(name) else str(exc))
    return VerifyReport(tag_dir, len(meta["files"]), len(meta["tensors"]), tuple(problems))
