"""Writing safetensors files by streaming, hashing on the way, and reading byte ranges back.

A safetensors file is an 8-byte little-endian header length, a JSON header (each tensor's
dtype, shape and ``[begin, end)`` byte offsets into the data section; padded with spaces to a
multiple of 8 bytes) and the tensors' raw bytes. Writing it here rather than through
``safetensors.torch.save_file`` lets the writer stream each tensor from its memory through one
16 MiB aligned buffer (no second copy of the whole file in RAM; ``O_DIRECT`` where allowed,
`_file_sink`), hash the bytes in the same pass that writes them (per `BLOCK_BYTES` block, on a
helper thread, so every byte is read once for hashing), fsync it, and tell the save hooks
when it is half written.

Each block gets two digests. Its SHA-256 makes the file's own digest, the SHA-256 of the
block digests (`digest_of_blocks`): a cryptographic fingerprint of the file that
``ds-checkpoint verify`` checks in full. Its XXH3-64 (format 3) is what a load checks: a load
must verify every byte it reads before it fills anything, and SHA-256 (about 1.1-1.5 GB/s
per core on the machines measured) made that check cost more than reading the file from
disk, while XXH3 runs at about 19 GB/s. For what a load guards against (a torn, truncated,
bit-flipped or swapped file) a 64-bit non-cryptographic digest misses one corruption in
2^64; against a deliberate forger neither helps, since the digests sit in the same
unsigned directory as the data. A reader verifies exactly the blocks it reads
(`_block_read`).
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import struct
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import NamedTuple

import torch
import xxhash

from deepshard.checkpoint._file_sink import FileSink
from deepshard.checkpoint._hash_threads import HashThreads
from deepshard.interface.errors import CheckpointError

__all__ = [
    "BLOCK_BYTES",
    "DTYPE_CODES",
    "FAST_DIGEST",
    "FileDigest",
    "bytes_of",
    "digest_of_blocks",
    "read_header",
    "sha256_of",
    "write_safetensors",
]

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

_CHUNK = 16 << 20  # bytes per write: large enough for disk speed, small enough to overlap
BLOCK_BYTES = 16 << 20
"""Size of the independently hashed blocks of a data file."""


FAST_DIGEST = "xxh3_64"
"""The block digest a load checks (format 3): XXH3-64, as 16 hex digits."""


class FileDigest(NamedTuple):
    """The digests and size of a written file.

    Attributes:
        sha256: The hex digest of the file: `digest_of_blocks` of ``blocks`` (formats 2-3).
        size: Its length in bytes.
        blocks: The SHA-256 of each `BLOCK_BYTES` block from the file's start (the last may
            be shorter).
        fast_blocks: The `FAST_DIGEST` of each of the same blocks, so that a load can check
            just the blocks it reads, quickly.
    """

    sha256: str
    size: int
    blocks: tuple[str, ...] = ()
    fast_blocks: tuple[str, ...] = ()


def bytes_of(tensor: torch.Tensor) -> memoryview:
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


class _BlockHasher:
    """SHA-256 and XXH3-64 of each ``BLOCK_BYTES`` block of a file, fed in arbitrary pieces."""

    def __init__(self) -> None:
        self.digests: list[str] = []
        self.fast_digests: list[str] = []
        self._current = hashlib.sha256()
        self._fast = xxhash.xxh3_64()
        self._filled = 0

    def feed(self, data: memoryview | bytes) -> None:
        view = memoryview(data)
        while len(view):
            take = min(len(view), BLOCK_BYTES - self._filled)
            self._current.update(view[:take])
            self._fast.update(view[:take])
            self._filled += take
            view = view[take:]
            if self._filled == BLOCK_BYTES:
                self.finish()

    def finish(self) -> None:
        if self._filled:
            self.digests.append(self._current.hexdigest())
            self.fast_digests.append(self._fast.hexdigest())
            self._current, self._fast, self._filled = hashlib.sha256(), xxhash.xxh3_64(), 0


def digest_of_blocks(blocks: Sequence[str]) -> str:
    """A file's digest from its block digests: SHA-256 of their hex strings, joined by commas."""
    return hashlib.sha256(",".join(blocks).encode()).hexdigest()


def _chunks(entries: Sequence[tuple[str, torch.Tensor]], half: int) -> Iterator[memoryview | None]:
    """The data section in chunks of at most ``_CHUNK`` bytes; ``None`` once ``half`` is reached."""
    written = 0
    if half == 0:
        yield None
    for _, tensor in entries:
        view = bytes_of(tensor)
        start = 0
        while start < len(view):
            # Stop a chunk at the half-way byte so the hook sees a genuinely partial file.
            stop = min(start + _CHUNK, len(view))
            if written < half < written + stop - start:
                stop = start + half - written
            yield view[start:stop]
            written += stop - start
            start = stop
            if written == half:
                yield None


def write_safetensors(
    path: Path,
    entries: Sequence[tuple[str, torch.Tensor]],
    *,
    halfway: Callable[[], None] | None = None,
    hashers: HashThreads | None = None,
) -> FileDigest:
    """Write CPU, contiguous ``entries`` to ``path``, fsync it, and return its digests.

    The bytes go through a `FileSink` (aligned ``O_DIRECT`` writes where the filesystem
    allows). With ``hashers``, a helper thread hashes each written piece into its blocks while
    this thread writes it (hashing and file writes release the GIL, so the two overlap).

    Args:
        path: The file to create (it must not exist).
        entries: ``(key, tensor)`` pairs in file order.
        halfway: Called once when half of the data is in the file (a save hook).
        hashers: `HashThreads` to hash on (else hashing runs on this thread).
    """
    for name, tensor in entries:
        if tensor.device.type != "cpu" or not tensor.is_contiguous():
            raise CheckpointError(f"{name}: internal error, tensor to write is not contiguous CPU")
    header = _header(entries)
    total = sum(t.numel() * t.element_size() for _, t in entries)
    blocks = _BlockHasher()
    with FileSink(path, buffer_bytes=_CHUNK, consume=blocks.feed, hashers=hashers) as sink:
        sink.write(struct.pack("<Q", len(header)) + header)
        for chunk in _chunks(entries, total // 2 if halfway is not None else -1):
            if chunk is None:
                sink.push()  # the file on disk is now genuinely partial
                halfway()  # type: ignore[misc]  # chunks are None only when halfway is set
                continue
            sink.write(chunk)
        size = sink.close()
    blocks.finish()
    digests = tuple(blocks.digests)
    return FileDigest(digest_of_blocks(digests), size, digests, tuple(blocks.fast_digests))


def sha256_of(path: Path) -> FileDigest:
    """The digest of an existing file (read in chunks)."""
    digest = hashlib.sha256()
    size = 0
    with open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
            size += len(chunk)
    return FileDigest(digest.hexdigest(), size)


def read_header(path: Path) -> tuple[int, dict[str, tuple[int, int]]]:
    """``(data_start, {key: (begin, end)})``: where each entry's bytes sit in the file."""
    try:
        with open(path, "rb") as handle:
            (length,) = struct.unpack("<Q", handle.read(8))
            header = json.loads(handle.read(length))
        spans = {
            k: (int(v["data_offsets"][0]), int(v["data_offsets"][1]))
            for k, v in header.items()
            if k != "__metadata__"
        }
    except (OSError, struct.error, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(
            f"{path}: unreadable safetensors header ({exc}); the file is damaged"
        ) from exc
    return 8 + length, spans
