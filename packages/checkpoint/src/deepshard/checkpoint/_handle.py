"""`SaveHandle`: the outcome of a save, and for a background one a way to wait for it."""

from __future__ import annotations

import atexit
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING

from deepshard.interface.errors import CheckpointError

if TYPE_CHECKING:
    import torch

__all__ = ["SaveHandle"]


class SaveHandle:
    """The outcome of a `save`; for a background save, a way to wait for it.

    A background save is also waited for at process exit. Pass the handle as ``after=`` to
    the next `save` or `load` so they wait for it first and raise its error.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        """The tag directory the save publishes."""
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._host_buffers: dict[str, torch.Tensor] = {}
        # The host snapshot of a background save: the next background save that waits for
        # this one (``after=``) copies into these instead of allocating (and page-faulting)
        # fresh memory every time.

    def done(self) -> bool:
        """Whether the save has finished (successfully or not)."""
        return self._done.is_set()

    def wait(self, timeout_s: float | None = None) -> Path:
        """Wait for the save and return its directory.

        Raises:
            CheckpointError: The save failed (the error it failed with), or it is still
                running after ``timeout_s``.
        """
        if not self._done.wait(timeout_s):
            raise CheckpointError(
                f"the save of {self.path} is still running after {timeout_s} s; wait longer"
            )
        if self._error is not None:
            if isinstance(self._error, CheckpointError):
                raise self._error
            raise CheckpointError(f"saving {self.path} failed: {self._error!r}") from self._error
        return self.path

    def _take_buffers(self) -> dict[str, torch.Tensor]:
        """The host snapshot buffers by key, handed over once (call only after `wait`)."""
        buffers, self._host_buffers = self._host_buffers, {}
        return buffers

    def _finish(self, error: BaseException | None) -> None:
        self._error = error
        self._done.set()
        atexit.unregister(self._wait_at_exit)

    def _wait_at_exit(self) -> None:
        self._done.wait()
        if self._error is not None:  # nobody is left to raise it to
            print(
                f"deepshard.checkpoint: saving {self.path} failed: {self._error}", file=sys.stderr
            )
