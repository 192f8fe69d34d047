"""The one error hierarchy every DeepShard package raises.

Each error names what is wrong and how to fix it. Catch :class:`DeepShardError` to handle any of
them; the subclasses say which kind of input was at fault.
"""

from __future__ import annotations

__all__ = [
    "CheckpointError",
    "CommError",
    "ConfigError",
    "DeepShardError",
    "LaunchError",
    "TopologyError",
]


class DeepShardError(Exception):
    """Base class of every error DeepShard raises on purpose."""


class ConfigError(DeepShardError, ValueError):
    """A configuration value is missing, misspelled, out of range or inconsistent."""


class TopologyError(DeepShardError, ValueError):
    """The requested parallel layout does not fit the world (sizes, axes, ranks)."""


class CheckpointError(DeepShardError):
    """A checkpoint is missing, corrupt, or does not match the model or topology."""


class LaunchError(DeepShardError):
    """The launcher could not start, place or supervise the ranks."""


class CommError(DeepShardError, RuntimeError):
    """A collective or process-group operation failed or was misused."""
