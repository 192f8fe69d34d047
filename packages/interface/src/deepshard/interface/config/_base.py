"""The base every config section derives from."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class ConfigModel(BaseModel):
    """A frozen config section: unknown keys are refused, field docstrings become descriptions.

    DeepSpeed key names are accepted through aliases; Python names work too.
    """

    model_config = ConfigDict(
        frozen=True,
        extra="forbid",
        populate_by_name=True,
        use_attribute_docstrings=True,
        validate_default=True,
    )
