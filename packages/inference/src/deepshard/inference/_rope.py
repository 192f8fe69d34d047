"""Reading a model config's rotary-embedding (RoPE) settings across transformers versions.

Transformers 4.x kept the RoPE base on the config as ``rope_theta`` and any scaling in
``rope_scaling``; transformers 5 moved both into one ``rope_parameters`` dict
(``{"rope_type": "default", "rope_theta": 10000.0, ...}``). Code that reads ``config.rope_theta``
directly breaks on one or the other, so every DeepShard reader goes through `rope_theta` here.

A fused decode path recomputes the rotary angles itself and therefore implements only the plain
(unscaled) RoPE. `check_rope_supported` refuses the scaled types (``linear``, ``dynamic``,
``yarn``, ``longrope``, ``llama3`` ...) with an error that names the type and the way out, instead
of generating subtly wrong text.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from deepshard.interface.errors import ConfigError

__all__ = ["DEFAULT_ROPE_THETA", "SUPPORTED_ROPE_TYPES", "check_rope_supported", "rope_theta"]

DEFAULT_ROPE_THETA = 10000.0
"""The base transformers itself assumes when a config names none (the original RoPE paper's)."""

SUPPORTED_ROPE_TYPES = frozenset({"default"})
"""RoPE types a fused path implements: only the unscaled rotation."""


def _rope_parameters(config: Any) -> Mapping[str, Any]:
    params = getattr(config, "rope_parameters", None)
    if params is None:
        return {}
    if not isinstance(params, Mapping):
        raise ConfigError(
            f"{type(config).__name__}.rope_parameters is a {type(params).__name__}, expected a "
            "dict such as {'rope_type': 'default', 'rope_theta': 10000.0}; fix the model config"
        )
    return params


def rope_theta(config: Any, *, default: float | None = DEFAULT_ROPE_THETA) -> float:
    """Returns the RoPE base of a Hugging Face model config.

    Looks at ``config.rope_theta`` (transformers 4.x) first, then at
    ``config.rope_parameters["rope_theta"]`` (transformers 5).

    Args:
        config: A model config (any object with those attributes).
        default: Returned when the config names no base; ``None`` makes a missing base an error.

    Returns:
        The base as a float.

    Raises:
        ConfigError: No base is found and ``default`` is ``None``, or the value is not a positive
            number.
    """
    value = getattr(config, "rope_theta", None)
    if value is None:
        value = _rope_parameters(config).get("rope_theta")
    if value is None:
        if default is None:
            raise ConfigError(
                f"{type(config).__name__} names no RoPE base: set config.rope_theta or "
                "config.rope_parameters['rope_theta']"
            )
        return float(default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ConfigError(
            f"{type(config).__name__} has RoPE base {value!r}; it must be a positive number "
            "(config.rope_theta or config.rope_parameters['rope_theta'])"
        )
    return float(value)


def _rope_type(config: Any) -> str:
    params = _rope_parameters(config)
    kind = params.get("rope_type", params.get("type"))
    if kind is None:
        scaling = getattr(config, "rope_scaling", None)
        if isinstance(scaling, Mapping):
            kind = scaling.get("rope_type", scaling.get("type"))
    return "default" if kind is None else str(kind)


def check_rope_supported(config: Any) -> None:
    """Refuses a config whose RoPE is scaled in a way a fused path does not implement.

    Args:
        config: A model config.

    Raises:
        ConfigError: The RoPE type is not in `SUPPORTED_ROPE_TYPES`; the message names it and
            says to run the model's own attention (no fused path) instead.
    """
    kind = _rope_type(config)
    if kind not in SUPPORTED_ROPE_TYPES:
        raise ConfigError(
            f"{type(config).__name__} uses RoPE type {kind!r}, which the fused inference path does "
            f"not implement (supported: {', '.join(sorted(SUPPORTED_ROPE_TYPES))}); generate with "
            "the model's own attention (no fused path / CUDA graph), or remove the RoPE scaling"
        )
