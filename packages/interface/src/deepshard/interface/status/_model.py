"""The rows of the status tables: a feature, who brings it, and when a config asks for it."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

__all__ = ["MISSING", "FeatureStatus", "PackageStatus", "When", "lookup"]

MISSING: Any = object()
"""What `lookup` returns for a key path that is absent (or under a section that is ``None``)."""


def lookup(tree: Mapping[str, Any], path: str) -> Any:
    """The value at a dotted DeepSpeed key path of a dumped config, or `MISSING`.

    Args:
        tree: A config dumped with DeepSpeed key names (``model_dump(by_alias=True)``).
        path: A dotted key path such as ``"zero_optimization.offload_optimizer.device"``.

    Returns:
        The value, or `MISSING` when a segment is absent or a section along the way is None.
    """
    value: Any = tree
    for part in path.split("."):
        if not isinstance(value, Mapping) or part not in value:
            return MISSING
        value = value[part]
    return value


@dataclass(frozen=True)
class When:
    """When a config asks for a feature: a test on one value under the entry's key path."""

    test: Literal["given", "true", "false", "above", "equals", "other_than"]
    """``given``: the user's config contains the key (any value, defaults included); ``true`` /
    ``false``: the value is that boolean; ``above``: a number above `value`; ``equals``: the
    value is `value`; ``other_than``: the value is present and is not `value`."""

    value: int | str | None = None
    """The operand of ``above``, ``equals`` and ``other_than``."""

    field: str = ""
    """The key under the entry's path the test reads (``"enabled"``, ``"device"``); empty reads
    the entry's path itself."""

    def holds(self, key: str, *, full: Mapping[str, Any], given: Mapping[str, Any]) -> bool:
        """Whether the config asks for the feature at ``key``.

        Args:
            key: The entry's key path.
            full: The whole config with defaults, DeepSpeed key names.
            given: Only what the user wrote (``exclude_unset``), DeepSpeed key names.

        Returns:
            True when the test holds; False when the value is absent.
        """
        path = f"{key}.{self.field}" if self.field else key
        if self.test == "given":
            return lookup(given, path) is not MISSING
        value = lookup(full, path)
        if value is MISSING or value is None:
            return False
        if self.test in ("true", "false"):
            return value is (self.test == "true")
        if self.test == "above":
            bound = self.value if isinstance(self.value, int) else 0
            return isinstance(value, (int, float)) and value > bound
        if self.test == "equals":
            return bool(value == self.value)
        return bool(value != self.value)

    def describe(self) -> str:
        """Markdown for the docs: when this test holds (``enabled: true``, ``above 1``)."""
        operand = {
            "given": "given",
            "true": "`true`",
            "false": "`false`",
            "above": f"above {self.value}",
            "equals": f"`{self.value}`",
            "other_than": f'other than `"{self.value}"`',
        }[self.test]
        return f"`{self.field}`: {operand}" if self.field else operand


@dataclass(frozen=True)
class FeatureStatus:
    """One row of the feature table: a config section or key whose feature is not all there.

    A key path that no row covers is available: the engine runs it as DeepSpeed does.
    """

    key: str
    """The DeepSpeed key path of the section or key (``"zero_optimization.stage"``); it covers
    every key below it unless a longer row says otherwise."""

    status: Literal["available", "planned", "ignored"]
    """``planned``: not available yet, so a config that asks for it is refused before anything
    is built (it would train something else than asked); ``ignored``: accepted, but it has no
    effect yet, so asking for it is reported once on rank 0; ``available``: an exception under
    a longer ``planned``/``ignored`` row."""

    feature: str
    """What the key turns on, in words (``"ZeRO stage 3"``)."""

    package: str | None
    """The distribution that brings the feature (``"deepshard-zero"``); None where DeepShard
    will not wire the key (it has no effect by design, said in `feature`)."""

    when: When = When("given")
    """When a config asks for the feature."""

    fix: str = "remove the key"
    """What to do instead, for a ``planned`` row (the end of the refusal message)."""


@dataclass(frozen=True)
class PackageStatus:
    """One row of the package table (README, docs index)."""

    distribution: str
    """The name to install (``"deepshard-zero"``)."""

    import_name: str
    """What to import (``"deepshard.zero"``)."""

    folder: str | None
    """Where it lives in the repository; None while it is planned."""

    summary: str
    """What it owns, one line of markdown."""

    status: Literal["available", "partial", "planned"]
    """``partial``: installable, with features still planned (said in `summary`)."""
