"""Where the engine's log lines go, so that progress shows without any logging set-up.

DeepSpeed prints its progress lines on rank 0 out of the box. DeepShard logs them through the
standard `logging` module (logger ``deepshard.engine``), which shows nothing below WARNING until
the application configures a handler. So `configure_logging` (called by ``initialize``) gives the
``deepshard`` logger a handler of its own when the application configured none, that is when
neither the root logger nor the ``deepshard`` logger has a handler:

* on rank 0 it writes every record at the ``deepshard`` logger's level to stderr: the config's
  ``log_level``, else INFO (an explicit level the application gave the logger is kept);
* on the other ranks it writes WARNING and above only, so N ranks do not print N copies of
  every line. ``DEEPSHARD_LOG_ALL_RANKS=1`` makes every rank write like rank 0 (and print its
  own progress line, see `log_all_ranks`).

The handler checks again at every record: once the application has a handler of its own (it
called ``logging.basicConfig`` after ``initialize``), the handler writes nothing and the record
reaches the application's handlers alone, so no line is ever printed twice (a handler the
application put on a child such as ``deepshard.engine`` counts too). Calling
``initialize`` again reuses the handler instead of adding another.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Mapping

from deepshard.engine._checks import ignored_settings
from deepshard.interface.config import DeepShardConfig
from deepshard.interface.errors import ConfigError
from deepshard.interface.status import ignored_keys

__all__ = ["ALL_RANKS_ENV", "announce", "configure_logging", "log_all_ranks"]

_log = logging.getLogger("deepshard.engine")

ALL_RANKS_ENV = "DEEPSHARD_LOG_ALL_RANKS"
"""Set to 1 to have every rank write DeepShard's log lines and progress, not only rank 0."""

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("", "0", "false", "no", "off")


def log_all_ranks(environ: Mapping[str, str]) -> bool:
    """Whether `ALL_RANKS_ENV` asks every rank to log like rank 0.

    Args:
        environ: The process environment (``os.environ``).

    Returns:
        True for 1/true/yes/on, False when unset or 0/false/no/off (any case).

    Raises:
        ConfigError: Any other value, naming the variable and the accepted ones.
    """
    value = environ.get(ALL_RANKS_ENV, "").strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ConfigError(
        f"{ALL_RANKS_ENV}={environ[ALL_RANKS_ENV]!r} is not a switch; set it to 1 to log on "
        "every rank, or 0 (or leave it unset) to log on rank 0 only"
    )


def _foreign_handlers(logger: logging.Logger) -> bool:
    """Whether the application gave the root or the ``deepshard`` logger a handler."""
    ours = [h for h in logger.handlers if not isinstance(h, _RankHandler)]
    return bool(logging.getLogger().handlers or ours)


class _RankHandler(logging.Handler):
    """Writes ``deepshard`` records to the current ``sys.stderr`` with the rank in front.

    The stream is looked up per record (as `logging.lastResort` does), so a redirected stderr
    is followed; nothing is written while the application has handlers of its own.
    """

    def __init__(self, logger: logging.Logger, rank: int) -> None:
        super().__init__()
        self._logger = logger
        self.setFormatter(
            logging.Formatter(f"[%(asctime)s] [rank {rank}] [%(levelname)s] %(name)s: %(message)s")
        )

    def emit(self, record: logging.LogRecord) -> None:
        if _foreign_handlers(self._logger) or self._below_has_handlers(record.name):
            return
        try:
            sys.stderr.write(self.format(record) + "\n")
            sys.stderr.flush()
        except Exception:  # the logging convention: report, never raise into the caller
            self.handleError(record)

    def _below_has_handlers(self, name: str) -> bool:
        """Whether a logger between the record's and ``deepshard`` (``deepshard.engine``) has
        the application's handler: it printed the record already."""
        logger: logging.Logger | None = logging.getLogger(name)
        while logger is not None and logger is not self._logger:
            if logger.handlers:
                return True
            logger = logger.parent
        return False


def configure_logging(*, rank: int, level: str | None, all_ranks: bool) -> None:
    """Applies the config's ``log_level`` and gives ``deepshard`` a handler if it has none.

    Args:
        rank: This process's global rank.
        level: The config's ``log_level`` (``"info"``...), or None to keep the logger's.
        all_ranks: `log_all_ranks`: write INFO on every rank, not only on rank 0.
    """
    logger = logging.getLogger("deepshard")
    if level is not None:
        logger.setLevel(level.upper())
    handler = next((h for h in logger.handlers if isinstance(h, _RankHandler)), None)
    if handler is None:
        if _foreign_handlers(logger):
            return  # the application decides where records go, and at which level
        handler = _RankHandler(logger, rank)
        logger.addHandler(handler)
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.INFO)  # the progress lines are INFO; WARNING would hide them
    handler.setLevel(logging.NOTSET if rank == 0 or all_ranks else logging.WARNING)


def announce(config: DeepShardConfig, *, rank: int, environ: Mapping[str, str]) -> None:
    """Sets logging up, then, on rank 0, warns about what the config asks for but has no effect.

    Two warnings at most: the accepted-but-inactive features (one line listing each, from the
    feature table), then every key path of the user's config that the engine ignores. With
    ``dump_state`` the config follows.

    Args:
        config: The validated config.
        rank: This process's global rank.
        environ: The process environment (read for `ALL_RANKS_ENV`).

    Raises:
        ConfigError: `ALL_RANKS_ENV` has a value that is not a switch.
    """
    configure_logging(rank=rank, level=config.log_level, all_ranks=log_all_ranks(environ))
    if rank != 0:
        return
    features = ignored_settings(config)
    if features:
        _log.warning("accepted but not active yet, so ignored: %s", "; ".join(features))
    keys = ignored_keys(config)
    if keys:
        _log.warning("ignored config keys: %s", ", ".join(keys))
    if config.dump_state:
        _log.info("config: %s", config.to_dict(exclude_defaults=True))
