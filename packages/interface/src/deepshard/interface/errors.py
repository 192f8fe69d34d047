"""The one error hierarchy every DeepShard package raises.

Each error names what is wrong and how to fix it. Catch `DeepShardError` to handle any of
them; the subclasses say which kind of input was at fault.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = [
    "CheckpointError",
    "CommError",
    "ConfigError",
    "DeepShardError",
    "LaunchError",
    "PartialLoadError",
    "TopologyError",
]


class DeepShardError(Exception):
    """Base class of every error DeepShard raises on purpose."""


class ConfigError(DeepShardError, ValueError):
    """A configuration value is missing, misspelled, out of range or inconsistent.

    Attributes:
        problems: One ``(key_path, message)`` pair per problem found, the key path written with
            DeepSpeed key names (``"zero_optimization.reduce_bucket_size"``; ``""`` for the
            whole config). Empty when the error was raised with a message only.
    """

    def __init__(self, message: str, problems: Sequence[tuple[str, str]] = ()) -> None:
        super().__init__(message)
        self.problems: list[tuple[str, str]] = list(problems)

    @classmethod
    def from_problems(cls, problems: Sequence[tuple[str, str]]) -> ConfigError:
        """Builds one error whose message lists every problem on its own line.

        Args:
            problems: ``(key_path, message)`` pairs, at least one.

        Returns:
            The error, with ``problems`` kept for programmatic use.
        """
        lines = [f"{path}: {message}" if path else message for path, message in problems]
        if len(lines) == 1:
            return cls(lines[0], problems)
        body = "\n".join(f"  - {line}" for line in lines)
        return cls(f"{len(lines)} problems in the DeepShard config:\n{body}", problems)

    def __reduce__(self) -> tuple[type[ConfigError], tuple[str, list[tuple[str, str]]]]:
        # Keep `problems` across pickling (errors travel back from worker processes).
        return (type(self), (str(self), self.problems))


class TopologyError(DeepShardError, ValueError):
    """The requested parallel layout does not fit the world (sizes, axes, ranks)."""


class CheckpointError(DeepShardError):
    """A checkpoint is missing, corrupt, or does not match the model or topology."""


class PartialLoadError(CheckpointError):
    """A load failed after it had started writing into the tensors it fills.

    Those tensors are partly overwritten: load a good checkpoint (or rebuild them) before using
    them. A load that fails before writing anything raises a plain `CheckpointError`.
    """


class LaunchError(DeepShardError):
    """The launcher could not start, place or supervise the ranks."""


class CommError(DeepShardError, RuntimeError):
    """A collective or process-group operation failed or was misused."""
