"""The script runner every rank starts in: ``python -u -m deepshard.launcher.script``.

``ds-launch`` starts each rank as ``python -u -m deepshard.launcher.script train.py ARGS`` (or
``... script -m pkg.train ARGS`` with ``--module``) instead of ``python -u train.py ARGS``. The
runner makes the script see what ``python train.py`` would show it (``__name__ == "__main__"``,
``sys.argv``, the script's directory first on ``sys.path``, an absolute ``__file__``), and
differs in two ways only:

- A `DeepShardError` that ends the script is reported, not printed as a traceback: its type
  and message go to the file named by ``DEEPSHARD_ERROR_FILE`` for the launcher to print once
  for all ranks (see `deepshard.launcher._rank_errors`), or to stderr when that is unset. The
  exit code is 1, as for any uncaught exception. ``DEEPSHARD_TRACEBACK=1`` restores the
  traceback.
- Tracebacks that are printed leave out the runner's own frames (and runpy's), so they start at
  the user's script as they would without the runner.

Only the standard library is imported before the script runs: the check for a DeepShard error
looks the class up in ``sys.modules``, since a script that raised one has imported it already.
"""

from __future__ import annotations

import importlib.machinery
import io
import os
import runpy
import sys
import types
from collections.abc import Sequence
from types import TracebackType

from deepshard.launcher._rank_errors import (
    ERROR_FILE_ENV,
    TRACEBACK_HINT,
    traceback_requested,
    write_error_file,
)

__all__ = ["main"]

_ERRORS_MODULE = "deepshard.interface.errors"
_USAGE = "usage: python -m deepshard.launcher.script (SCRIPT | -m MODULE) [ARGS ...]"


def _is_deepshard_error(error: BaseException) -> bool:
    errors = sys.modules.get(_ERRORS_MODULE)
    return errors is not None and isinstance(error, errors.DeepShardError)


def _report(error: BaseException) -> None:
    path = os.environ.get(ERROR_FILE_ENV)
    if path:
        try:
            write_error_file(path, error)
            return
        except OSError:
            pass  # the launcher then shows the rank's output, which gets the message below
    sys.stderr.write(f"{type(error).__name__}: {error}\n({TRACEBACK_HINT})\n")
    sys.stderr.flush()


def _runner_frames(filename: str) -> bool:
    return filename in (__file__, runpy.__file__) or filename.startswith("<frozen runpy")


def _without_runner_frames(traceback: TracebackType | None) -> TracebackType | None:
    """``traceback`` from its first frame outside this module and runpy onwards."""
    while traceback is not None and _runner_frames(traceback.tb_frame.f_code.co_filename):
        traceback = traceback.tb_next
    return traceback


def _excepthook(
    kind: type[BaseException], error: BaseException, traceback: TracebackType | None
) -> None:
    trimmed = _without_runner_frames(traceback)
    # The default hook prints the exception's own __traceback__, not its argument.
    sys.__excepthook__(kind, error.with_traceback(trimmed), trimmed)


def _run_file(name: str) -> None:
    # Not runpy.run_path: it sets sys.argv[0] to the path it is given, and puts the runner back
    # as __main__ when the script returns (atexit handlers and pickling look __main__ up late).
    path = os.path.abspath(name)
    sys.path[0] = os.path.dirname(os.path.realpath(path))
    with io.open_code(path) as handle:
        code = compile(handle.read(), path, "exec")
    module = types.ModuleType("__main__")
    module.__file__ = path
    module.__cached__ = None  # type: ignore[attr-defined]
    module.__loader__ = importlib.machinery.SourceFileLoader("__main__", path)
    sys.modules["__main__"] = module
    exec(code, module.__dict__)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the script or module named by ``argv`` like ``python`` would.

    Meant as the process's entry point: it replaces ``sys.argv`` and ``sys.path[0]``.

    Args:
        argv: ``[SCRIPT, ARGS...]`` or ``["-m", MODULE, ARGS...]`` (default ``sys.argv[1:]``).

    Returns:
        0 when the script returns, 1 after a reported `DeepShardError`, 2 for bad arguments;
        a ``SystemExit`` from the script passes through with its code.
    """
    words = list(sys.argv[1:] if argv is None else argv)
    module = words[:1] == ["-m"]
    if module:
        words = words[1:]
    if not words or not words[0]:
        sys.stderr.write(f"{_USAGE}\n")
        return 2
    name, args = words[0], words[1:]
    sys.argv = [name, *args]  # run_module then puts the module's path in sys.argv[0]
    try:
        if module:
            runpy.run_module(name, run_name="__main__", alter_sys=True)  # sys.path[0]: the cwd
        else:
            _run_file(name)
    except Exception as error:
        if not _is_deepshard_error(error) or traceback_requested(os.environ):
            raise
        _report(error)
        return 1
    return 0


if __name__ == "__main__":
    sys.excepthook = _excepthook  # this process is the rank: its hook is ours to set
    sys.exit(main())
