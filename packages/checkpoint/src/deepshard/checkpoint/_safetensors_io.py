"""Writing safetensors files by streaming, hashing on the way, and reading byte ranges back.

A safetensors file is an 8-byte little-endian header length, a JSON header (each tensor's
dtype, shape and ``[begin, end)`` byte offsets into the data section; padded with spaces to a
multiple of 8 bytes) and the tensors' raw bytes. Writing it here rather than through
``safetensors.torch.save_file`` lets the writer stream each tensor straight from its memory
(no second copy of the whole file in RAM), compute the file's SHA-256 as it goes, fsync it,
and tell the save hooks when it is half written. Reading uses the ``safetensors`` library
(``safe_open(...).get_slice``), which maps the file and reads only the ranges asked for, and
proves the files are standard.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import struct
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NamedTuple

import torch

from deepshard.interface.errors import CheckpointError

__all__ = ["DTYPE_CODES", "FileDigest", "sha256_of", "write_safetensors"]

DTYPE_CODES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}
"""The safetensors name of each dtype a checkpoint can hold."""

_CHUNK = 64 << 20  # bytes per write: large enough for disk speed, small enough to interleave


class FileDigest(NamedTuple):
    """The SHA-256 and size of a written file.

    Attributes:
        sha256: The hex digest of the whole file.
        size: Its length in bytes.
    """

    sha256: str
    size: int


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    # ctypes over the tensor's own memory: no numpy (not a dependency) and no copy; the caller
    # keeps the tensor alive while the view is used.
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0:
        return memoryview(b"")
    return memoryview((ctypes.c_ubyte * nbytes).from_address(tensor.data_ptr())).cast("B")


def _header(entries: Sequence[tuple[str, torch.Tensor]]) -> bytes:
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, tensor in entries:
        if tensor.dtype not in DTYPE_CODES:
            raise CheckpointError(
                f"{name}: dtype {tensor.dtype} cannot be stored in safetensors; cast it to one "
                f"of {sorted(str(d) for d in DTYPE_CODES)}"
            )
        size = tensor.numel() * tensor.element_size()
        header[name] = {
            "dtype": DTYPE_CODES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    return text + b" " * (-len(text) % 8)


def write_safetensors(
    path: Path,
    entries: Sequence[tuple[str, torch.Tensor]],
    *,
    halfway: Callable[[], None] | None = None,
) -> FileDigest:
    """Write CPU, contiguous ``entries`` to ``path``, fsync it, and return its digest.

    Args:
        path: The file to create (it must not exist).
        entries: ``(key, tensor)`` pairs in file order.
        halfway: Called once after about half of the data is written (a save hook).
    """
    for name, tensor in entries:
        if tensor.device.type != "cpu" or not tensor.is_contiguous():
            raise CheckpointError(f"{name}: internal error, tensor to write is not contiguous CPU")
    header = _header(entries)
    total = sum(t.numel() * t.element_size() for _, t in entries)
    digest = hashlib.sha256()
    half = total // 2 if halfway is not None else -1
    written = 0
    with open(path, "xb") as handle:
        for head in (struct.pack("<Q", len(header)), header):
            handle.write(head)
            digest.update(head)
        if written == half:  # an empty data section is half written at once
            halfway()  # type: ignore[misc]
        for _, tensor in entries:
            view = _bytes_of(tensor)
            start = 0
            while start < len(view):
                # Stop a chunk at the half-way byte so the hook sees a genuinely partial file.
                stop = min(start + _CHUNK, len(view))
                if written < half < written + stop - start:
                    stop = start + half - written
                chunk = view[start:stop]
                handle.write(chunk)
                digest.update(chunk)
                written += len(chunk)
                start = stop
                if written == half and halfway is not None:
                    handle.flush()
                    halfway()
        handle.flush()
        os.fsync(handle.fileno())
    return FileDigest(digest.hexdigest(), 8 + len(header) + total)


def sha256_of(path: Path) -> FileDigest:
    """The digest of an existing file (read in chunks)."""
    digest = hashlib.sha256()
    size = 0
    with open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
            size += len(chunk)
    return FileDigest(digest.hexdigest(), size)
