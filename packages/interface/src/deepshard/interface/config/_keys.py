"""Key spellings of config fields: the DeepSpeed JSON key, and every spelling accepted on input."""

from __future__ import annotations

import types
from typing import Any, Union, get_args, get_origin

from pydantic import AliasChoices, AliasPath
from pydantic.fields import FieldInfo

__all__ = ["accepted_keys", "json_key", "unwrap_optional"]


def json_key(name: str, info: FieldInfo) -> str:
    """Returns the key a field is written under in a DeepSpeed JSON config.

    Args:
        name: The Python attribute name of the field.
        info: The field's pydantic metadata.

    Returns:
        The serialization alias when there is one, else the alias, else the attribute name.
    """
    return info.serialization_alias or info.alias or name


def accepted_keys(name: str, info: FieldInfo) -> tuple[str, ...]:
    """Returns every input key that sets a field: its JSON key first, then aliases, then its name.

    Args:
        name: The Python attribute name of the field.
        info: The field's pydantic metadata.

    Returns:
        The distinct spellings, in that order.
    """
    keys = [json_key(name, info)]
    if info.alias:
        keys.append(info.alias)
    choices: list[Any] = []
    if isinstance(info.validation_alias, AliasChoices):
        choices = list(info.validation_alias.choices)
    elif info.validation_alias is not None:
        choices = [info.validation_alias]
    for choice in choices:
        if isinstance(choice, str):
            keys.append(choice)
        elif isinstance(choice, AliasPath) and len(choice.path) == 1:
            keys.append(str(choice.path[0]))
    keys.append(name)
    return tuple(dict.fromkeys(keys))


def unwrap_optional(annotation: Any) -> tuple[Any, ...]:
    """Returns the members of a union annotation other than ``None`` (the annotation alone if none).

    Args:
        annotation: A type annotation such as ``int | None`` or ``ZeroConfig``.

    Returns:
        The non-``None`` members.
    """
    if get_origin(annotation) in (Union, types.UnionType):
        return tuple(arg for arg in get_args(annotation) if arg is not type(None))
    return (annotation,)
