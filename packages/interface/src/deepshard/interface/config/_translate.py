"""Turns a pydantic ``ValidationError`` into a `ConfigError` that speaks DeepSpeed keys.

Pydantic reports each problem with a location tuple such as ``("zero_optimization",
"offload_param", "device")``. We walk that location through the model classes, so every segment is
written as the DeepSpeed JSON key (``stage3_prefetch_bucket_size`` rather than the Python name),
list indices become ``[i]`` and the tags pydantic adds for union members are dropped. Unknown keys
get the nearest valid key of their section (over field names and aliases), or, when DeepShard
refuses that DeepSpeed key on purpose, the reason and the alternative.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterator, Sequence
from typing import Any, get_args, get_origin

from pydantic import BaseModel, ValidationError
from pydantic_core import ErrorDetails

from deepshard.interface.config._base import RAW_PROBLEMS_ERROR
from deepshard.interface.config._keys import accepted_keys, json_key, unwrap_optional
from deepshard.interface.config._removed import HF_AUTO_MESSAGE, refused_key_message
from deepshard.interface.errors import ConfigError

__all__ = ["config_error_from_validation"]

_MAX_LISTED_KEYS = 20
_BOUNDS = {
    "greater_than": ">",
    "greater_than_equal": ">=",
    "less_than": "<",
    "less_than_equal": "<=",
}
_BOUND_CTX = {"greater_than": "gt", "greater_than_equal": "ge", "less_than": "lt"}


def _is_model(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def _collapse(annotation: Any) -> Any:
    members = unwrap_optional(annotation)
    return members[0] if len(members) == 1 else annotation


def _find_field(model: type[BaseModel], key: str) -> tuple[str, Any] | None:
    for name, info in model.model_fields.items():
        if key in accepted_keys(name, info):
            return json_key(name, info), info.annotation
    return None


def _step_into_container(annotation: Any, segment: str | int) -> Any:
    origin = get_origin(annotation)
    args = get_args(annotation)
    if origin in (list, tuple, set, frozenset) and isinstance(segment, int) and args:
        return _collapse(args[0])
    if origin is dict and len(args) == 2:
        return _collapse(args[1])
    for member in unwrap_optional(annotation):  # a union tag names the member it tried
        if _is_model(member) and member.__name__ == segment:
            return member
    return None


def _resolve(
    loc: Sequence[str | int], model: type[BaseModel]
) -> tuple[list[str], type[BaseModel] | None]:
    """Maps a pydantic location to DeepSpeed key segments and the model holding the last key."""
    parts: list[str] = []
    current: Any = model
    holder: type[BaseModel] | None = None
    for segment in loc:
        if _is_model(current) and isinstance(segment, str):
            holder = current
            found = _find_field(current, segment)
            parts.append(found[0] if found else segment)
            current = _collapse(found[1]) if found else None
            continue
        container = get_origin(current) in (list, tuple, set, frozenset, dict)
        if isinstance(segment, int) and container:
            if parts:
                parts[-1] = f"{parts[-1]}[{segment}]"
            else:
                parts.append(f"[{segment}]")
        elif get_origin(current) is dict:
            parts.append(str(segment))
            holder = None
        current = _step_into_container(current, segment)
    return parts, holder


def _suggestion(key: str, holder: type[BaseModel] | None) -> str:
    if holder is None:
        return "unknown key"
    keys = sorted({k for n, i in holder.model_fields.items() for k in accepted_keys(n, i)})
    close = difflib.get_close_matches(key, keys, n=1, cutoff=0.6)
    if close:
        return f"unknown key; did you mean {close[0]!r}?"
    if len(keys) <= _MAX_LISTED_KEYS:
        return "unknown key; accepted keys: " + ", ".join(keys)
    return f"unknown key (see the {holder.__name__} reference for the accepted keys)"


def _reason(error: ErrorDetails) -> str:
    kind = error["type"]
    ctx = error.get("ctx") or {}
    if kind == "missing":
        return "required key is missing"
    if kind == "literal_error":
        return f"expected one of {ctx.get('expected')}"
    if kind in _BOUNDS:
        bound = ctx.get(_BOUND_CTX.get(kind, "le"))
        return f"must be {_BOUNDS[kind]} {bound}"
    if kind in ("model_type", "model_attributes_type", "dict_type"):
        return "expected a JSON object (a section of keys)"
    message = error["msg"].removeprefix("Value error, ")
    return message[:1].lower() + message[1:]


def _describe(error: ErrorDetails, model: type[BaseModel]) -> Iterator[tuple[str, str, str | None]]:
    """Yields ``(key path, reason, repr of the given value or None)`` for one pydantic error."""
    parts, holder = _resolve(error["loc"], model)
    path = ".".join(parts)
    kind = error["type"]
    if kind == RAW_PROBLEMS_ERROR:
        for sub_path, message in (error.get("ctx") or {}).get("problems", ()):
            yield ".".join(p for p in (path, sub_path) if p), message, None
    elif kind == "extra_forbidden":
        refused = refused_key_message(path)
        yield path, refused or _suggestion(str(error["loc"][-1]), holder), None
    elif error.get("input") == "auto":
        yield path, HF_AUTO_MESSAGE, None
    else:
        given = error.get("input")
        yield path, _reason(error), None if kind == "missing" else repr(given)


def config_error_from_validation(
    exc: ValidationError, model: type[BaseModel], prefix: str = ""
) -> ConfigError:
    """Builds the `ConfigError` for a failed validation of ``model``.

    Args:
        exc: The pydantic error.
        model: The model class that was validated (its fields give the key names).
        prefix: The DeepSpeed key path of ``model`` inside a whole config, or ``""``.

    Returns:
        One error listing every problem as ``key.path: what is wrong; got value``.
    """
    grouped: dict[str, tuple[list[str], str | None]] = {}
    for error in exc.errors(include_url=False):
        for path, reason, given in _describe(error, model):
            full = ".".join(p for p in (prefix, path) if p)
            reasons, _ = grouped.setdefault(full, ([], given))
            if reason not in reasons:
                reasons.append(reason)
    problems = [
        (path, " or ".join(reasons) + (f"; got {given}" if given is not None else ""))
        for path, (reasons, given) in grouped.items()
    ]
    return ConfigError.from_problems(problems)
