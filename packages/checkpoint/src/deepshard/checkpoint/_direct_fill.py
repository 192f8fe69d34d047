"""Filling destinations straight from the data files, with no host buffer in between.

A copy that moves a plain byte range (no scale, the saved dtype) into CPU storage needs no
staging: `fill_direct` reads it with ``preadv`` into the destination's own memory. The load
checked those bytes first (`_block_read.verify_blocks`), which left them in the page cache,
so this read is a memory copy; a host buffer as large as the checkpoint would instead cost a
page fault per 4 KiB, as much as the disk read on the machines measured. `split_direct`
separates those copies from the rest (scaled pieces, dtype casts, accelerator destinations),
which go through host buffers and `_reshard.apply_copies`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from deepshard.checkpoint._reshard import Copy
from deepshard.checkpoint._safetensors_io import bytes_of, read_header
from deepshard.interface.errors import CheckpointError

__all__ = ["FillTask", "fill_direct", "split_direct"]


@dataclass(frozen=True)
class FillTask:
    """The copies filling one tensor of ``like``.

    Attributes:
        name: The tensor's key in the checkpoint.
        dest: The flat local storage to fill.
        copies: What goes where (`_reshard.plan_copies`).
        files: The data file holding each saved rank's entry, by rank (as a string).
        dtype: The saved dtype.
    """

    name: str
    dest: torch.Tensor
    copies: list[Copy]
    files: dict[str, str]
    dtype: torch.dtype

    @property
    def itemsize(self) -> int:
        """Bytes per saved element."""
        return self.dtype.itemsize


def split_direct(tasks: list[FillTask]) -> tuple[list[FillTask], list[FillTask]]:
    """``(direct, buffered)``: the copies `fill_direct` can read straight into place, the rest."""
    direct, buffered = [], []
    for task in tasks:
        plain = task.dest.device.type == "cpu" and task.dest.dtype == task.dtype
        mine = [c for c in task.copies if plain and c.factor == 1.0]
        others = [c for c in task.copies if not (plain and c.factor == 1.0)]
        if mine:
            direct.append(FillTask(task.name, task.dest, mine, task.files, task.dtype))
        if others:
            buffered.append(FillTask(task.name, task.dest, others, task.files, task.dtype))
    return direct, buffered


def fill_direct(tag_dir: Path, tasks: list[FillTask]) -> int:
    """Read each copy's bytes straight into its destination; return the bytes read."""
    headers: dict[str, tuple[int, dict[str, tuple[int, int]]]] = {}
    handles: dict[str, int] = {}
    total = 0
    try:
        for task in tasks:
            for copy in task.copies:
                file = task.files.get(str(copy.saved_rank))
                if file is None:
                    raise CheckpointError(
                        f"{task.name}: the metadata names no file for rank {copy.saved_rank}"
                    )
                if file not in handles:
                    headers[file] = read_header(tag_dir / file)
                    handles[file] = os.open(tag_dir / file, os.O_RDONLY)
                data_start, spans = headers[file]
                offset = data_start + spans[task.name][0] + copy.source * task.itemsize
                target = bytes_of(task.dest[copy.dest : copy.dest + copy.length])
                while len(target):
                    got = os.preadv(handles[file], [target], offset)
                    if not got:
                        raise CheckpointError(f"{tag_dir / file} ended at byte {offset}: truncated")
                    target, offset, total = target[got:], offset + got, total + got
    except OSError as exc:
        raise CheckpointError(f"{tag_dir}: cannot read a data file ({exc}); it is damaged") from exc
    finally:
        for fd in handles.values():
            os.close(fd)
    return total
