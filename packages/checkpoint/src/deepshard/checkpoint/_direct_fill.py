"""Filling destinations straight from the data files, with no host buffer in between.

A copy that moves a plain byte range (no scale, the saved dtype) into CPU storage needs no
staging: `fill_direct` reads it with ``preadv`` into the destination's own memory, and the
load then checks the bytes where they landed (`_landed`; a checkpoint older than format 3 is
checked first, on threads, which leaves its bytes in the page cache for this read). A host
buffer as large as the checkpoint would instead cost a page fault per 4 KiB, as much as the
disk read on the machines measured. `split_direct`
separates those copies from the rest (scaled pieces, dtype casts, accelerator destinations),
which go through host buffers and `_reshard.apply_copies`. Given a pool, the reads run on
several threads at once.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from deepshard.checkpoint._reshard import Copy
from deepshard.checkpoint._safetensors_io import bytes_of, read_header
from deepshard.interface.errors import CheckpointError

__all__ = ["DirectRead", "FillTask", "direct_reads", "fill_direct", "read_into", "split_direct"]

_CHUNK_BYTES = 32 << 20  # one read of `fill_direct`: large, and many of them for the threads


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


@dataclass(frozen=True)
class DirectRead:
    """One read of `fill_direct`: bytes of a data file straight into a destination's memory.

    Attributes:
        file: The data file (a name in the tag directory).
        offset: Where the bytes start in the file.
        target: The destination's memory (its length is the read's).
    """

    file: str
    offset: int
    target: memoryview


def direct_reads(tag_dir: Path, tasks: list[FillTask]) -> list[DirectRead]:
    """Every read of the tasks' copies, cut in `_CHUNK_BYTES` pieces; the caller keeps the
    tasks' tensors alive while the reads' targets are used."""
    headers: dict[str, tuple[int, dict[str, tuple[int, int]]]] = {}
    reads = []
    for task in tasks:
        for copy in task.copies:
            file = task.files.get(str(copy.saved_rank))
            if file is None:
                raise CheckpointError(
                    f"{task.name}: the metadata names no file for rank {copy.saved_rank}"
                )
            if file not in headers:
                headers[file] = read_header(tag_dir / file)
            data_start, spans = headers[file]
            offset = data_start + spans[task.name][0] + copy.source * task.itemsize
            target = bytes_of(task.dest[copy.dest : copy.dest + copy.length])
            for lo in range(0, len(target), _CHUNK_BYTES):
                reads.append(DirectRead(file, offset + lo, target[lo : lo + _CHUNK_BYTES]))
    return reads


def read_into(fd: int, target: memoryview, offset: int, where: Path) -> int:
    """Fill ``target`` with the bytes of ``fd`` from ``offset`` on; return its length."""
    total = len(target)
    while len(target):
        got = os.preadv(fd, [target], offset)
        if not got:
            raise CheckpointError(f"{where} ended at byte {offset}: truncated")
        target, offset = target[got:], offset + got
    return total


def fill_direct(
    tag_dir: Path, reads: list[DirectRead], pool: ThreadPoolExecutor | None = None
) -> int:
    """Perform ``reads`` (`direct_reads`); return the bytes read.

    With ``pool`` the reads run on its threads, several at once: ``preadv`` releases the GIL,
    so page-cache copies use several cores and disk reads queue deeper.
    """
    handles: dict[str, int] = {}
    try:
        for read in reads:
            if read.file not in handles:
                handles[read.file] = os.open(tag_dir / read.file, os.O_RDONLY)
        args = [(handles[r.file], r.target, r.offset, tag_dir / r.file) for r in reads]
        if pool is None:
            return sum(read_into(*arg) for arg in args)
        futures = [pool.submit(read_into, *arg) for arg in args]
        try:
            return sum(future.result() for future in futures)
        finally:
            for future in futures:  # close no file a thread still reads
                if not future.cancel():
                    future.exception()
    except OSError as exc:
        raise CheckpointError(f"{tag_dir}: cannot read a data file ({exc}); it is damaged") from exc
    finally:
        for fd in handles.values():
            os.close(fd)
