"""Relaying a child's output to the terminal while remembering its last lines.

Without ``--log_dir`` each rank's stdout and stderr come through pipes: they are copied to the
launcher's stdout and stderr as they arrive, each line prefixed with ``[rank N] `` when the job
has several ranks (a world of one streams unchanged), and the last lines are kept in a ring
buffer for the failure report. With ``--log_dir`` the rank writes straight to its file (it keeps
writing even if the launcher dies) and the report reads the file's tail instead.
"""

from __future__ import annotations

import collections
import contextlib
import os
from typing import BinaryIO

__all__ = ["LineTail", "StreamRelay", "read_file_tail"]

_MAX_PARTIAL = 1 << 16
"""A line longer than this is passed on in pieces rather than held back."""


class LineTail:
    """The last ``limit`` lines of a child's output (both streams, in arrival order)."""

    def __init__(self, limit: int) -> None:
        self._lines: collections.deque[str] = collections.deque(maxlen=limit)
        self._partial: dict[int, bytes] = {}

    def feed(self, stream: int, data: bytes) -> None:
        """Add ``data`` read from ``stream`` (lines are split per stream)."""
        pending = self._partial.get(stream, b"") + data
        *complete, rest = pending.split(b"\n")
        self._lines.extend(line.decode(errors="replace") for line in complete)
        if len(rest) > _MAX_PARTIAL:
            self._lines.append(rest.decode(errors="replace"))
            rest = b""
        self._partial[stream] = rest

    def lines(self) -> list[str]:
        """The remembered lines, an unfinished last line included."""
        unfinished = [part.decode(errors="replace") for part in self._partial.values() if part]
        return [*self._lines, *unfinished][-(self._lines.maxlen or 1) :]


class StreamRelay:
    """Copies one child stream to a destination, prefixing whole lines."""

    def __init__(self, destination: BinaryIO, prefix: bytes, stream: int, tail: LineTail) -> None:
        self._destination = destination
        self._prefix = prefix
        self._stream = stream
        self._tail = tail
        self._partial = b""

    def feed(self, data: bytes) -> None:
        """Pass on ``data`` (a chunk read from the pipe)."""
        self._tail.feed(self._stream, data)
        if not self._prefix:
            self._write(data)
            return
        pending = self._partial + data
        cut = pending.rfind(b"\n") + 1
        if cut == 0 and len(pending) > _MAX_PARTIAL:
            cut = len(pending)
        self._partial = pending[cut:]
        if cut:
            lines = pending[:cut].splitlines(keepends=True)
            self._write(b"".join(self._prefix + line for line in lines))

    def close(self) -> None:
        """Pass on an unfinished last line (the child ended without a newline)."""
        if self._partial:
            self._write(self._prefix + self._partial + b"\n")
            self._partial = b""

    def _write(self, data: bytes) -> None:
        # A closed terminal or pipe must not stop supervision: the ranks still need cleaning up.
        with contextlib.suppress(OSError, ValueError):
            self._destination.write(data)
            self._destination.flush()


def read_file_tail(path: str, limit: int, max_bytes: int = 1 << 16) -> list[str]:
    """The last ``limit`` lines of the file at ``path`` (``[]`` if it cannot be read)."""
    try:
        with open(path, "rb") as handle:
            handle.seek(0, os.SEEK_END)
            size = handle.tell()
            handle.seek(max(0, size - max_bytes))
            data = handle.read()
    except OSError:
        return []
    lines = data.decode(errors="replace").splitlines()
    return lines[-limit:]
