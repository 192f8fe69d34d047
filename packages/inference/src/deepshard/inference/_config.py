"""Resolving ``init_inference``'s config argument and keyword arguments into one `InferenceConfig`.

DeepSpeed lets both carry settings; DeepShard accepts a key in both places only when the two
values are equal, so a keyword argument never silently wins over (or loses to) the config.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from deepshard.interface import ConfigError
from deepshard.interface.config import InferenceConfig

__all__ = ["resolve_config"]


def _canonical_names() -> dict[str, str]:
    """Every accepted spelling (field name or DeepSpeed alias) to the field name."""
    names = {"mp_size": "mp_size"}
    for name, info in InferenceConfig.model_fields.items():
        names[name] = name
        if info.alias:
            names[info.alias] = name
    return names


def _as_mapping(config: InferenceConfig | Mapping[str, Any] | None) -> dict[str, Any]:
    if config is None:
        return {}
    if isinstance(config, InferenceConfig):
        return {name: getattr(config, name) for name in config.model_fields_set}
    if isinstance(config, Mapping):
        return dict(config)
    raise ConfigError(
        f"config must be an InferenceConfig, a dict or None, not {type(config).__name__}",
        [("", "pass InferenceConfig(...) or a dict of DeepSpeed init_inference keys")],
    )


def _comparable(value: Any) -> Any:
    dump = getattr(value, "model_dump", None)
    return dump() if callable(dump) else value


def resolve_config(
    config: InferenceConfig | Mapping[str, Any] | None, kwargs: Mapping[str, Any]
) -> InferenceConfig:
    """Merges ``config`` and ``kwargs`` into a validated `InferenceConfig`.

    Raises:
        ConfigError: A key given in both with different values (named with both values), or
            any validation problem of the merged config.
    """
    if isinstance(config, InferenceConfig) and not kwargs:
        return config
    merged = _as_mapping(config)
    names = _canonical_names()
    given = {names.get(key, key): key for key in merged}
    for key, value in kwargs.items():
        canonical = names.get(key, key)
        if canonical in given:
            first = given[canonical]
            ours = InferenceConfig(**{first: merged[first]})
            theirs = InferenceConfig(**{key: value})
            if _comparable(getattr(ours, canonical, None)) != _comparable(
                getattr(theirs, canonical, None)
            ) or (canonical == "mp_size" and merged[first] != value):
                raise ConfigError(
                    f"{key!r} is given as a keyword argument ({value!r}) and in the config "
                    f"({merged[first]!r}); give it once, or the same value in both",
                    [(key, f"{value!r} disagrees with the config's {merged[first]!r}")],
                )
            continue
        merged[key] = value
        given[canonical] = key
    return InferenceConfig(**merged)
