"""Reading a config file: JSON, or HJSON when the optional ``hjson`` package is installed."""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any

from deepshard.interface.errors import ConfigError

__all__ = ["load_config_file"]


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise ConfigError(f"{key}: the key appears twice in the same object; keep only one")
        result[key] = value
    return result


def _parse_hjson(text: str, path: Path, json_error: str | None) -> Any:
    """Parses HJSON; ``json_error`` says why JSON failed (None: chosen by the extension)."""
    why = "the file has the .hjson extension" if json_error is None else json_error
    try:
        hjson = importlib.import_module("hjson")
    except ImportError:
        raise ConfigError(
            f"{path}: {why}; reading it as HJSON needs the hjson package: "
            "pip install 'deepshard-interface[hjson]'"
        ) from None
    try:
        loaded = hjson.loads(text, object_pairs_hook=_no_duplicates)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from exc
    except ValueError as exc:
        also = "" if json_error is None else f"{json_error}, and "
        raise ConfigError(f"{path}: {also}not valid HJSON ({exc})") from exc
    return _plain(loaded)


def _plain(value: Any) -> Any:
    """Turns the OrderedDicts and tuples a parser may return into plain dicts and lists."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


def load_config_file(path: str | Path) -> dict[str, Any]:
    """Reads a DeepSpeed/DeepShard config file into a dictionary.

    A ``.hjson`` file is read as HJSON. Any other file is read as JSON; if that fails and the
    ``hjson`` package is importable, it is read as HJSON (HJSON is a superset of JSON).

    Args:
        path: The file to read.

    Returns:
        The top-level JSON object.

    Raises:
        ConfigError: The file is missing, is not valid (H)JSON, repeats a key, or its top level
            is not an object.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read the config file ({exc.strerror})") from exc
    if path.suffix.lower() == ".hjson":
        loaded: Any = _parse_hjson(text, path, None)
    else:
        try:
            loaded = json.loads(text, object_pairs_hook=_no_duplicates)
        except json.JSONDecodeError as exc:
            why = f"not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg})"
            loaded = _parse_hjson(text, path, why)
        except ConfigError as exc:
            raise ConfigError(f"{path}: {exc}") from exc
    if not isinstance(loaded, dict):
        raise ConfigError(
            f"{path}: the top level must be a JSON object, got {type(loaded).__name__}"
        )
    return loaded
