"""DeepSpeed's old offload switches in ``zero_optimization``, read as DeepSpeed 0.19.7 reads them.

Configs written for DeepSpeed before 0.5 say ``"cpu_offload": true`` (optimizer state on the
CPU), ``"cpu_offload_param": true`` (parameters on the CPU, stage 3) and
``"cpu_offload_use_pin_memory"``. DeepSpeed 0.19.7 still accepts them with a deprecation
warning and rewrites the first two into the sections that replaced them: true becomes
``offload_optimizer`` / ``offload_param`` with ``{"device": "cpu"}``, false (or null) becomes
no offload. Giving an old switch together with its replacement section is refused, as DeepSpeed
refuses it. The rewritten sections then meet every rule a written-out section meets (parameter
offload below stage 3 is ignored with a warning; an engine without offload refuses
``offload_optimizer``).

Deliberate deviation: DeepSpeed warns about ``cpu_offload_use_pin_memory`` and drops it, so its
rewritten sections pin host memory even where the old config said not to. Here it becomes the
``pin_memory`` of the sections the old switches create; next to written-out sections only (or
alone) it has no effect, and the warning says so.
"""

from __future__ import annotations

import json
import warnings
from typing import Any

from deepshard.interface.config._base import raw_problems_error

__all__ = ["LEGACY_OFFLOAD_SWITCHES", "PIN_MEMORY_SWITCH", "translate_legacy_offload"]

LEGACY_OFFLOAD_SWITCHES = {"cpu_offload": "offload_optimizer", "cpu_offload_param": "offload_param"}
"""Old switch → the section that replaced it."""

PIN_MEMORY_SWITCH = "cpu_offload_use_pin_memory"
"""The old switch for pinned host buffers of both kinds of offload."""

_SECTION = "zero_optimization"


def _switch_value(data: dict[str, Any], key: str, problems: list[tuple[str, str]]) -> bool | None:
    """Pops an old switch: its boolean, or None for null (DeepSpeed's "not set")."""
    value = data.pop(key)
    if value is None or isinstance(value, bool):
        return value
    problems.append((key, f"expected true or false, got {value!r}"))
    return None


def _warn(key: str, replacement: str) -> None:
    warnings.warn(
        f"{_SECTION}.{key} is deprecated (an old DeepSpeed spelling); {replacement}",
        FutureWarning,
        stacklevel=2,
    )


def translate_legacy_offload(data: dict[str, Any]) -> dict[str, Any]:
    """Rewrites the old offload switches of a raw ``zero_optimization`` section.

    Args:
        data: The section as given (not modified).

    Returns:
        The section with ``cpu_offload``, ``cpu_offload_param`` and
        ``cpu_offload_use_pin_memory`` replaced by the sections they stand for; ``data`` itself
        when it has none of them. Each old key present raises a ``FutureWarning`` that names
        it and its replacement.

    Raises:
        PydanticCustomError: An old switch that is not a boolean, or one given together with
            its replacement section (key paths relative to the section).
    """
    present = [k for k in (*LEGACY_OFFLOAD_SWITCHES, PIN_MEMORY_SWITCH) if k in data]
    if not present:
        return data
    data = dict(data)
    problems: list[tuple[str, str]] = []
    given_pin = PIN_MEMORY_SWITCH in data
    pin = _switch_value(data, PIN_MEMORY_SWITCH, problems) if given_pin else None
    created: list[str] = []
    for old, new in LEGACY_OFFLOAD_SWITCHES.items():
        if old not in data:
            continue
        before = len(problems)
        on = bool(_switch_value(data, old, problems))
        if len(problems) > before:
            continue
        if new in data:
            problems.append((old, f"given together with {new}; keep only {new}"))
            continue
        if not on:
            _warn(old, f"false is no offload, the default: remove it ({new} replaces it)")
            continue
        section: dict[str, Any] = {"device": "cpu"}
        if pin is not None:
            section["pin_memory"] = pin
        data[new] = section
        created.append(new)
        _warn(old, f'read as "{new}": {json.dumps(section)}; write that instead')
    if problems:
        raise raw_problems_error(problems)
    if given_pin:
        applied = pin is not None and created
        effect = f"applied to {' and '.join(created)}" if applied else "no effect here"
        _warn(PIN_MEMORY_SWITCH, f"set pin_memory inside offload_optimizer / offload_param "
              f"instead ({effect})")  # fmt: skip
    return data
