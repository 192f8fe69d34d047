"""The error raised when an accelerator cannot be selected or used as asked."""

from __future__ import annotations

from deepshard.interface.errors import DeepShardError

__all__ = ["AcceleratorError"]


class AcceleratorError(DeepShardError, ValueError):
    """An accelerator name is unknown, the device is not usable, or an argument does not fit it.

    It is a ``ValueError`` too, because every case is a value the caller chose: a name, a local
    rank, a tensor on the wrong device.
    """
