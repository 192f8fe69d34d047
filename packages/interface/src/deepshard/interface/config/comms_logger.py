"""`comms_logger`: per-collective logging of size, latency and bandwidth."""

from __future__ import annotations

from pydantic import Field

from deepshard.interface.config._base import ConfigModel

__all__ = ["CommsLoggerConfig"]


class CommsLoggerConfig(ConfigModel):
    """The `comms_logger` section: what the communication logger records and prints."""

    drops_auto = True

    enabled: bool = False
    """Record every collective issued through `deepshard.comm`. When false nothing is timed."""

    verbose: bool = False
    """Print one line per collective as it completes (rank 0 only), besides the summary."""

    prof_all: bool = True
    """Log every op. When false, only the ops named in `prof_ops` are logged."""

    debug: bool = False
    """Append the calling function's name to each log name, to tell call sites apart."""

    prof_ops: list[str] = Field(default_factory=list)
    """Op names to log when `prof_all` is false, e.g. `["all_reduce", "all_gather_into_tensor"]`."""
