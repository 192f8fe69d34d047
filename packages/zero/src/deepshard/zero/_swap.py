"""`Swapper`: raw tensor bytes to and from files, asynchronously, on a small thread pool.

NVMe offload keeps optimizer state in files and moves one sub-group at a time through host
buffers. A request is a contiguous byte range of a tensor and of a file; it is cut into blocks
of ``aio.block_size`` bytes, and the blocks are handed to ``aio.intra_op_parallelism`` worker
threads in batches of ``aio.queue_depth`` blocks (one block per batch with
``aio.single_submit``). Workers call ``os.preadv``/``os.pwrite`` on the tensor's own memory (no
pickles, no intermediate copies) and release the GIL while the kernel does the I/O, so reading
sub-group k+1 and writing sub-group k-1 overlap the optimizer step of sub-group k. With
``aio.overlap_events`` false every request is waited for before it returns (the I/O is then
synchronous, for debugging or for a device that dislikes concurrent requests).

``aio.use_gds`` (GPUDirect Storage) has no meaning here: the host buffers are what the step
reads, so the bytes always pass through host memory.

The files live in one directory the swapper owns; `Swapper.close` (or garbage collection of
the swapper, through a finalizer) closes them and removes the directory.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import tempfile
import weakref
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from deepshard.interface.config import AioConfig
from deepshard.interface.errors import ConfigError

__all__ = ["SwapRequest", "Swapper"]

_Work = Callable[[int, memoryview, int, list[tuple[int, int]]], None]


class SwapRequest:
    """The pending batches of one read or write; `wait` re-raises an I/O error."""

    def __init__(self, futures: list[Future[None]]) -> None:
        self._futures = futures

    def wait(self) -> None:
        """Block until every batch is done (idempotent)."""
        for future in self._futures:
            future.result()
        self._futures = []


def _byte_view(tensor: torch.Tensor) -> memoryview:
    """The tensor's own memory as a writable byte buffer (any dtype, bf16 included)."""
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise ValueError("swap buffers must be contiguous host tensors")
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0:
        return memoryview(bytearray(0))
    # ctypes over the tensor's own memory: no numpy (not a dependency); the caller keeps the
    # tensor alive until its request is waited for (`Swapper.write`/`read` say so)
    return memoryview((ctypes.c_ubyte * nbytes).from_address(tensor.data_ptr())).cast("B")


def _write_blocks(fd: int, data: memoryview, offset: int, blocks: list[tuple[int, int]]) -> None:
    for lo, hi in blocks:
        done = 0
        while lo + done < hi:  # pwrite may write less than asked
            done += os.pwrite(fd, data[lo + done : hi], offset + lo + done)


def _read_blocks(fd: int, data: memoryview, offset: int, blocks: list[tuple[int, int]]) -> None:
    for lo, hi in blocks:
        done = 0
        while lo + done < hi:
            got = os.preadv(fd, [data[lo + done : hi]], offset + lo + done)
            if got == 0:
                raise OSError(f"swap file ended before byte {offset + lo + done}")
            done += got


class Swapper:
    """Files of raw tensor bytes under a fresh directory in ``root``.

    Args:
        root: Where the swapper makes its directory (``offload_optimizer.nvme_path``).
        aio: Block size, batch depth, thread count, submission and overlap of the requests.
        prefix: Start of the directory's name (made unique, e.g. per rank and optimizer).
        key: The config key of ``root``, for the error message.

    Raises:
        ConfigError: ``root`` does not exist or is not a writable directory.
    """

    def __init__(
        self,
        root: Path,
        aio: AioConfig,
        *,
        prefix: str,
        key: str = "zero_optimization.offload_optimizer.nvme_path",
    ) -> None:
        if not root.is_dir() or not os.access(root, os.W_OK):
            raise ConfigError.from_problems(
                [
                    (
                        key,
                        f"{str(root)!r} is not a writable directory; create it or point "
                        "nvme_path at a local NVMe mount",
                    )
                ]
            )
        self.directory = Path(tempfile.mkdtemp(prefix=prefix, dir=root))
        self._aio = aio
        self._pool = ThreadPoolExecutor(
            max_workers=aio.intra_op_parallelism, thread_name_prefix="deepshard-swap"
        )
        self._fds: dict[str, int] = {}
        self._finalizer = weakref.finalize(self, _release, self._pool, self._fds, self.directory)

    def path(self, name: str) -> Path:
        """The file of ``name``."""
        return self.directory / name

    def _fd(self, name: str) -> int:
        if name not in self._fds:
            flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0)
            self._fds[name] = os.open(self.path(name), flags, 0o600)
        return self._fds[name]

    def _batches(self, nbytes: int) -> list[list[tuple[int, int]]]:
        block = self._aio.block_size
        blocks = [(lo, min(lo + block, nbytes)) for lo in range(0, nbytes, block)]
        depth = 1 if self._aio.single_submit else self._aio.queue_depth
        return [blocks[i : i + depth] for i in range(0, len(blocks), depth)]

    def _submit(self, work: _Work, name: str, tensor: torch.Tensor, offset: int) -> SwapRequest:
        fd, data = self._fd(name), _byte_view(tensor)
        futures = [
            self._pool.submit(work, fd, data, offset, batch) for batch in self._batches(len(data))
        ]
        request = SwapRequest(futures)
        if not self._aio.overlap_events:
            request.wait()
        return request

    def write(self, name: str, tensor: torch.Tensor, *, offset: int = 0) -> SwapRequest:
        """Write ``tensor``'s bytes into file ``name`` at byte ``offset``.

        ``tensor`` must stay alive and unchanged until the request is waited for.
        """
        return self._submit(_write_blocks, name, tensor, offset)

    def read(self, name: str, tensor: torch.Tensor, *, offset: int = 0) -> SwapRequest:
        """Read ``tensor.nbytes`` bytes of file ``name`` from byte ``offset`` into ``tensor``."""
        return self._submit(_read_blocks, name, tensor, offset)

    def close(self) -> None:
        """Wait for the workers, close the files and remove the directory (idempotent)."""
        self._finalizer()


def _release(pool: ThreadPoolExecutor, fds: dict[str, int], directory: Path) -> None:
    pool.shutdown(wait=True)
    for fd in fds.values():
        os.close(fd)
    fds.clear()
    shutil.rmtree(directory, ignore_errors=True)
