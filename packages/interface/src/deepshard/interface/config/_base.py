"""The base every config section derives from."""

from __future__ import annotations

import warnings
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, ValidationError, field_validator, model_validator
from pydantic_core import PydanticCustomError

from deepshard.interface.config._keys import accepted_keys, unwrap_optional

__all__ = ["RAW_PROBLEMS_ERROR", "ConfigModel", "must_stay_false", "raw_problems_error"]

RAW_PROBLEMS_ERROR = "deepshard_config"
"""The pydantic error type that carries DeepShard's own problems as ``(key path, message)``."""


def raw_problems_error(problems: list[tuple[str, str]]) -> PydanticCustomError:
    """Wraps problems found by a DeepShard validator so the error translation keeps their paths.

    Args:
        problems: ``(key path relative to the model, message)`` pairs.

    Returns:
        An error to raise from a pydantic validator.
    """
    summary = "; ".join(f"{path}: {message}" if path else message for path, message in problems)
    return PydanticCustomError(
        RAW_PROBLEMS_ERROR, "{summary}", {"summary": summary, "problems": tuple(problems)}
    )


def _is_number(annotation: Any) -> bool:
    members = unwrap_optional(annotation)
    return bool(members) and all(member in (int, float) for member in members)


def must_stay_false(field: str, message: str) -> Any:
    """A field validator refusing ``true`` for ``field`` with ``message`` (a feature DeepShard
    does not carry, accepted only switched off). Assign it in the class body."""

    def refuse(cls: type[BaseModel], value: bool) -> bool:
        if value:
            raise raw_problems_error([("", message)])
        return value

    return field_validator(field)(classmethod(refuse))


class ConfigModel(BaseModel):
    """A frozen config section: unknown keys are refused, field docstrings become descriptions.

    DeepSpeed key names are accepted through aliases; Python names work too. Constructing a
    section directly (``ZeroConfig(stage=5)``) raises `deepshard.interface.ConfigError`
    with DeepSpeed key paths, like `DeepShardConfig.from_dict` does.
    """

    model_config = ConfigDict(
        frozen=True,
        extra="forbid",
        populate_by_name=True,
        use_attribute_docstrings=True,
        validate_default=True,
    )

    config_key: ClassVar[str] = ""
    """Where the section sits in a DeepSpeed config (``"zero_optimization.offload_param"``)."""

    drops_auto: ClassVar[bool] = False
    """Whether a value of ``"auto"`` means "the default" here, with a warning naming the key.

    True for the sections DeepSpeed 0.19.7 parses with its pydantic base, which drops every
    ``"auto"`` value before validation (so e.g. ``stage3_max_live_parameters: "auto"`` written
    by OpenRLHF gets the default there); elsewhere (top-level numbers, optimizer params)
    DeepSpeed fails on ``"auto"`` and DeepShard refuses it with the Hugging Face message."""

    def __init__(self, /, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as exc:
            from deepshard.interface.config._translate import config_error_from_validation

            raise config_error_from_validation(exc, type(self), self.config_key) from exc

    # Nested sections are validated by pydantic-core directly; marking this __init__ as the base
    # one keeps pydantic from routing nested validation through it (the translation above is only
    # for a section built on its own).
    __init__.__pydantic_base_init__ = True  # type: ignore[attr-defined]

    @model_validator(mode="before")
    @classmethod
    def _check_raw_keys(cls, data: Any) -> Any:
        """Refuses a setting given under two spellings, and booleans where a number belongs."""
        if not isinstance(data, dict):
            return data
        if cls.drops_auto:
            data = _drop_auto(cls, data)
        problems: list[tuple[str, str]] = []
        for name, info in cls.model_fields.items():
            present = [key for key in accepted_keys(name, info) if key in data]
            if len(present) > 1:
                spelled = " and ".join(repr(key) for key in present)
                problems.append((present[0], f"given twice, as {spelled}; keep only one"))
            for key in present:
                if isinstance(data[key], bool) and _is_number(info.annotation):
                    problems.append((key, f"expected a number, got the boolean {data[key]}"))
        if problems:
            raise raw_problems_error(problems)
        return data


def _drop_auto(cls: type[ConfigModel], data: dict[str, Any]) -> dict[str, Any]:
    """``data`` without its ``"auto"`` values, each reported in one warning with its default."""
    auto = [key for key, value in data.items() if isinstance(value, str) and value == "auto"]
    if not auto:
        return data
    defaults = {
        key: info.default
        for name, info in cls.model_fields.items()
        for key in accepted_keys(name, info)
    }
    where = f"{cls.config_key}." if cls.config_key else ""
    named = ", ".join(
        f"{where}{key} (default {defaults[key]!r})" if key in defaults else f"{where}{key}"
        for key in auto
    )
    warnings.warn(
        f"'auto' is a Hugging Face Trainer placeholder the Trainer fills in; given to the engine "
        f"directly it means the default here, as DeepSpeed reads it: {named}. Write the values "
        "to choose them",
        UserWarning,
        stacklevel=2,
    )
    return {key: value for key, value in data.items() if key not in auto}
