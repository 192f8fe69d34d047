"""Which environment variables travel to other nodes, and how they are written safely.

A local launch hands every rank the launcher's whole environment. A remote node gets a fresh
login environment plus:

- the variables whose names start with one of `EXPORT_PREFIXES` (DeepSpeed's list, plus
  ``TORCH``, ``HF_``, ``DEEPSHARD`` and ``OMP_`` so that thread settings and
  ``DEEPSHARD_RESTART_COUNT`` follow the job);
- ``VIRTUAL_ENV``, and the directory of the launcher's Python put in front of the node's own
  ``PATH``, so that tools installed in the job's environment are found (the node runs the same
  Python executable path, so the environment must exist at that path on every node);
- the ``KEY=VALUE`` lines of the environment files, read from the home directory, then the
  launch directory (which wins): DeepSpeed's ``.deepspeed_env`` (or the name in
  ``DS_ENV_FILE``, as DeepSpeed reads it), then ``.deepshard_env`` (which wins over it in the
  same directory). They apply to local ranks as well, so a job behaves the same on one node
  and on many.

Every value is written with `shlex.quote`, so spaces, quotes and ``;`` arrive verbatim and
nothing in a value is ever run by the remote shell.
"""

from __future__ import annotations

import os
import re
import shlex
from collections.abc import Mapping

from deepshard.interface.errors import LaunchError

__all__ = [
    "DEEPSPEED_ENV_FILE",
    "ENV_FILE_NAME",
    "EXPORT_PREFIXES",
    "env_file_names",
    "exported_variables",
    "parse_env_file",
    "read_env_files",
    "shell_assignments",
]

EXPORT_PREFIXES = ("NCCL", "PYTHON", "UCX", "MLFLOW", "HF_", "TORCH", "DEEPSHARD", "OMP_")
"""Variables whose names start with one of these are sent to remote nodes."""
ENV_FILE_NAME = ".deepshard_env"
"""Name of the extra-variables file looked up in the home and launch directories."""
DEEPSPEED_ENV_FILE = ".deepspeed_env"
"""DeepSpeed's name for it, read too (before ours); ``DS_ENV_FILE`` replaces it, as there."""

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def exported_variables(environ: Mapping[str, str]) -> dict[str, str]:
    """The launcher's variables that remote nodes receive (prefixes and ``VIRTUAL_ENV``)."""
    chosen = {
        name: value
        for name, value in environ.items()
        if name.startswith(EXPORT_PREFIXES) and _NAME.fullmatch(name)
    }
    if "VIRTUAL_ENV" in environ:
        chosen["VIRTUAL_ENV"] = environ["VIRTUAL_ENV"]
    return dict(sorted(chosen.items()))


def parse_env_file(text: str, source: str) -> dict[str, str]:
    """Parse ``KEY=VALUE`` lines; ``#`` lines and blank lines are skipped.

    The value is everything after the first ``=`` with the surrounding blanks removed, and one
    pair of matching quotes around the whole of it (``A="two words"``, as dotenv files and
    DeepSpeed's shell export read it) removed too; quotes inside it are kept.

    Raises:
        LaunchError: A line has no ``=`` or its key is not a variable name (file and line named).
    """
    variables: dict[str, str] = {}
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        key, equals, value = line.partition("=")
        key = key.strip()
        if not equals or not _NAME.fullmatch(key):
            raise LaunchError(
                f"{source}:{number}: {line!r} is not KEY=VALUE with a variable name as KEY"
            )
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        variables[key] = value
    return variables


def env_file_names(environ: Mapping[str, str]) -> tuple[str, ...]:
    """The environment files read in each directory, in order (a later one wins)."""
    return (environ.get("DS_ENV_FILE") or DEEPSPEED_ENV_FILE, ENV_FILE_NAME)


def read_env_files(
    directories: list[str], names: tuple[str, ...] = (ENV_FILE_NAME,)
) -> dict[str, str]:
    """Merge the environment files ``names`` found in ``directories`` (later ones win).

    Raises:
        LaunchError: A file exists but cannot be read or is malformed.
    """
    merged: dict[str, str] = {}
    for directory in directories:
        for name in names:
            path = os.path.join(directory, name)
            if not os.path.isfile(path):
                continue
            try:
                with open(path, encoding="utf-8") as handle:
                    merged.update(parse_env_file(handle.read(), path))
            except (OSError, UnicodeDecodeError) as error:
                raise LaunchError(f"cannot read {path}: {error}") from error
    return merged


def shell_assignments(variables: Mapping[str, str]) -> list[str]:
    """``NAME=value`` words for ``env``/a shell, every value quoted with `shlex.quote`.

    Raises:
        LaunchError: A name is not a valid variable name (it could not be quoted safely).
    """
    words = []
    for name, value in variables.items():
        if not _NAME.fullmatch(name):
            raise LaunchError(f"cannot export {name!r}: not a valid environment variable name")
        words.append(f"{name}={shlex.quote(value)}")
    return words
