"""What every DeepSpeed-style schedule shares: the position, the write into the optimizer, checks.

A schedule here is a pure function of one integer, ``last_batch_iteration``, the index of the
last batch trained (``-1`` before the first). The learning rate written into the optimizer at
position ``k`` is the one the *next* optimizer step uses, so the first optimizer step runs with
the value at ``-1`` (written at construction) and `step()` moves to ``k + 1``. That is
DeepSpeed's contract, which these classes keep value for value; it differs from
``torch.optim.lr_scheduler.LRScheduler`` (whose constructor already steps to epoch 0), which is
why these classes do not derive from it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NoReturn, Protocol, runtime_checkable

import torch

from deepshard.interface.errors import CheckpointError, ConfigError

__all__ = [
    "BatchSchedule",
    "LRSchedule",
    "ParamGroupOwner",
    "check_bool",
    "check_int",
    "check_number",
    "check_per_group",
    "group_lrs",
    "refuse",
    "restore_base_lrs",
    "write_value",
]


@runtime_checkable
class LRSchedule(Protocol):
    """What the engine needs from a learning-rate schedule; `build_scheduler` returns one."""

    def step(self) -> None:
        """Advances the schedule by one applied optimizer step and writes the new values."""

    def get_last_lr(self) -> list[float]:
        """The learning rate of each param group, as last written into the optimizer."""

    def state_dict(self) -> dict[str, Any]:
        """The schedule's position as plain, JSON-serialisable data."""

    def load_state_dict(self, state_dict: dict[str, Any], /) -> None:
        """Restores a position saved by `state_dict`."""


class ParamGroupOwner(Protocol):
    """Anything with torch-style ``param_groups``: a ``torch.optim.Optimizer`` or a wrapper."""

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """One dict per parameter group, holding at least ``"lr"``."""


def refuse(name: str, message: str) -> NoReturn:
    """Raises the `ConfigError` for one bad parameter, named by its key."""
    raise ConfigError.from_problems([(name, message)])


def check_number(name: str, value: object, *, minimum: float | None = None) -> float:
    """`value` as a finite float, at least `minimum` when one is given."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        refuse(name, f"must be a number, got {value!r}")
    number = float(value)
    if not math.isfinite(number):
        refuse(name, f"must be finite, got {value!r}")
    if minimum is not None and number < minimum:
        refuse(name, f"must be at least {minimum:g}, got {value!r}")
    return number


def check_int(name: str, value: object, *, minimum: int | None = None) -> int:
    """`value` as an int (a bool is refused), at least `minimum` when one is given."""
    if isinstance(value, bool) or not isinstance(value, int):
        refuse(name, f"must be an integer, got {value!r}")
    if minimum is not None and value < minimum:
        refuse(name, f"must be an integer of at least {minimum}, got {value!r}")
    return value


def check_bool(name: str, value: object) -> bool:
    """`value` when it is a bool (``true``/``false`` in JSON)."""
    if not isinstance(value, bool):
        refuse(name, f"must be true or false, got {value!r}")
    return value


def check_per_group(
    name: str,
    value: object,
    group_count: int,
    *,
    minimum: float | None = None,
    maximum: float | None = None,
) -> list[float]:
    """One float per param group: a list is taken as is, a single number is repeated.

    Raises:
        ConfigError: On a list whose length is not the number of param groups, or an entry out
            of range; the key is `name` (with ``[i]`` for a list entry).
    """
    if isinstance(value, (list, tuple)):
        if len(value) != group_count:
            refuse(
                name,
                f"a list must hold one value per optimizer param group ({group_count}), got "
                f"{len(value)}; give {group_count} values or a single number for all groups",
            )
        entries = [(f"{name}[{i}]", v) for i, v in enumerate(value)]
    else:
        entries = [(name, value)] * group_count
    out = [check_number(key, v, minimum=minimum) for key, v in entries]
    if maximum is not None:
        for (key, v), number in zip(entries, out, strict=True):
            if number > maximum:
                refuse(key, f"must be at most {maximum:g}, got {v!r}")
    return out


def group_lrs(optimizer: ParamGroupOwner) -> list[float]:
    """The current learning rate of each param group, as floats (a tensor lr is read out)."""
    return [float(group["lr"]) for group in optimizer.param_groups]


def write_value(group: dict[str, Any], key: str, value: float) -> None:
    """Sets ``group[key]``, in place when the optimizer keeps it as a tensor (capturable lr)."""
    current = group.get(key)
    if isinstance(current, torch.Tensor):
        current.fill_(value)
    else:
        group[key] = value


class BatchSchedule:
    """The stateful shell around a schedule function: position, writes, save and restore.

    Subclasses define `_lrs_at` (the pure schedule) and may add restorable values through
    `_extra_state` / `_load_extra_state`.

    Attributes:
        optimizer: The optimizer whose param groups the schedule writes.
        last_batch_iteration: Index of the last batch trained; ``-1`` before the first.
    """

    def __init__(self, optimizer: ParamGroupOwner, last_batch_iteration: int) -> None:
        self.optimizer = optimizer
        self.last_batch_iteration = check_int(
            "last_batch_iteration", last_batch_iteration, minimum=-1
        )
        self._last_lr: list[float] = []

    @property
    def group_count(self) -> int:
        """How many param groups the schedule was built for."""
        return len(self.optimizer.param_groups)

    def _lrs_at(self, iteration: int) -> list[float]:
        raise NotImplementedError

    def _extra_state(self) -> dict[str, Any]:
        return {}

    def _load_extra_state(self, state: dict[str, Any]) -> None:
        del state

    def get_lr(self) -> list[float]:
        """The learning rate of each param group at the current position (nothing is written)."""
        return self._lrs_at(self.last_batch_iteration)

    def get_last_lr(self) -> list[float]:
        """The learning rate of each param group, as last written into the optimizer."""
        return list(self._last_lr)

    def step(self, last_batch_iteration: int | None = None) -> None:
        """Moves to the next position (or to `last_batch_iteration`) and writes its values.

        Call it once per applied optimizer step, after ``optimizer.step()``.

        Args:
            last_batch_iteration: Jump to this position instead of the next one, as DeepSpeed's
                ``step(batch_iteration)`` does.
        """
        if last_batch_iteration is None:
            self.last_batch_iteration += 1
        else:
            self.last_batch_iteration = check_int(
                "last_batch_iteration", last_batch_iteration, minimum=-1
            )
        self._apply()

    def _apply(self) -> None:
        """Writes the values of the current position into the optimizer's param groups."""
        groups = self.optimizer.param_groups
        lrs = self.get_lr()
        if len(groups) != len(lrs):
            refuse(
                "optimizer.param_groups",
                f"the optimizer has {len(groups)} param groups but the schedule was built for "
                f"{len(lrs)}; build the schedule after the last add_param_group()",
            )
        for group, lr in zip(groups, lrs, strict=True):
            write_value(group, "lr", lr)
        self._last_lr = lrs

    def state_dict(self) -> dict[str, Any]:
        """The position (and any value read from the optimizer) as JSON-serialisable data."""
        return {"last_batch_iteration": self.last_batch_iteration, **self._extra_state()}

    def load_state_dict(self, state_dict: dict[str, Any], /) -> None:
        """Restores a position saved by `state_dict` and writes its values into the optimizer.

        A DeepSpeed scheduler state (``{"last_batch_iteration": k}``) loads as well.

        Raises:
            CheckpointError: If the position is missing or not an integer of at least -1, or a
                key is not one this schedule saves.
        """
        known = {"last_batch_iteration", *self._extra_state()}
        unknown = sorted(set(state_dict) - known)
        if unknown:
            raise CheckpointError(
                f"{type(self).__name__} state has unknown keys {unknown}; expected {sorted(known)}"
            )
        iteration = state_dict.get("last_batch_iteration")
        if isinstance(iteration, bool) or not isinstance(iteration, int) or iteration < -1:
            raise CheckpointError(
                f"{type(self).__name__} state needs 'last_batch_iteration' as an integer >= -1, "
                f"got {iteration!r}"
            )
        try:
            self._load_extra_state(state_dict)
        except ConfigError as exc:
            raise CheckpointError(f"{type(self).__name__} state is invalid: {exc}") from exc
        self.last_batch_iteration = iteration
        self._apply()


def restore_base_lrs(state: dict[str, Any], group_count: int) -> list[float] | None:
    """The ``base_lrs`` entry of a saved state, checked; `None` when the state has none."""
    if "base_lrs" not in state:
        return None
    return check_per_group("base_lrs", _as_list(state["base_lrs"]), group_count, minimum=0.0)


def _as_list(value: object) -> Sequence[object]:
    if not isinstance(value, (list, tuple)):
        refuse("base_lrs", f"must be a list with one lr per param group, got {value!r}")
    return value
