"""Questions a config answers against the feature table: what it asks for that is not there."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from deepshard.interface.config import DeepShardConfig
from deepshard.interface.status._features import FEATURES
from deepshard.interface.status._model import FeatureStatus

__all__ = ["asked_features", "ignored_keys", "planned_problems", "status_of"]

_BY_KEY = {row.key: row for row in FEATURES}


def status_of(key: str) -> FeatureStatus | None:
    """The row that covers a DeepSpeed key path: its own, else its nearest section's.

    Args:
        key: A dotted key path (``"zero_optimization.stage3_max_live_parameters"``).

    Returns:
        The longest row whose key is ``key`` or a section above it; None when the key is
        available (no row covers it).
    """
    parts = key.split(".")
    for end in range(len(parts), 0, -1):
        row = _BY_KEY.get(".".join(parts[:end]))
        if row is not None:
            return row
    return None


def _dumps(config: DeepShardConfig) -> tuple[dict[str, Any], dict[str, Any]]:
    full = config.model_dump(mode="json", by_alias=True)
    given = config.model_dump(mode="json", by_alias=True, exclude_unset=True)
    return full, given


def asked_features(config: DeepShardConfig, status: str) -> list[FeatureStatus]:
    """The rows of one status whose feature the config asks for, in table order.

    Args:
        config: The validated config.
        status: ``"planned"`` or ``"ignored"``.

    Returns:
        The rows whose `When` holds.
    """
    full, given = _dumps(config)
    leaves = _leaf_paths(given)
    return [
        row
        for row in FEATURES
        if row.status == status
        and row.when.holds(row.key, full=full, given=given)
        and _asks_a_covered_key(row, leaves)
    ]


def _asks_a_covered_key(row: FeatureStatus, leaves: list[str]) -> bool:
    """Whether a ``given`` section row is asked for through a key it covers itself.

    A section row (``tensor_parallel``, ``moe``) speaks for the keys no longer row claims: a
    config that sets only ``tensor_parallel.autotp_size`` (an ``available`` row) does not ask
    for "an AutoTP setting AutoTP does not read". Other tests read one value and always count.
    """
    if row.when.test != "given" or row.when.field:
        return True
    inside = [p for p in leaves if p == row.key or p.startswith(f"{row.key}.")]
    return any(status_of(p) is row for p in inside)


def planned_problems(config: DeepShardConfig) -> list[tuple[str, str]]:
    """``(key path, message)`` for every planned feature the config asks for (to refuse).

    Args:
        config: The validated config.

    Returns:
        One problem per row, naming the feature, the package that will bring it and the fix.
    """
    problems = []
    for row in asked_features(config, "planned"):
        owner = f" (planned in {row.package})" if row.package else ""
        problems.append((row.key, f"{row.feature} is not available yet{owner}; {row.fix}"))
    return problems


def _leaf_paths(tree: Mapping[str, Any], prefix: str = "") -> list[str]:
    paths = []
    for key, value in tree.items():
        path = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            paths += _leaf_paths(value, f"{path}.")
        else:
            paths.append(path)
    return paths


def ignored_keys(config: DeepShardConfig) -> list[str]:
    """Every key path the user wrote that the engine accepts but does not act on.

    A key counts when the row covering it is ``ignored`` and its feature is asked for (a
    disabled monitor's keys are honoured: nothing runs, as asked).

    Args:
        config: The validated config.

    Returns:
        The key paths with DeepSpeed names, in the schema's order.
    """
    asked = {row.key for row in asked_features(config, "ignored")}
    _, given = _dumps(config)
    ignored = []
    for path in _leaf_paths(given):
        row = status_of(path)
        if row is not None and row.key in asked:
            ignored.append(path)
    return ignored
