"""Argument checks shared by the optimizers: each bad value becomes a `ConfigError`.

The problems carry the argument name as their key (``"lr"``, ``"betas"``), so `build_optimizer`
can prefix them with ``optimizer.params.`` and the message names the config key to fix.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from deepshard.interface.errors import ConfigError

__all__ = ["check_betas", "check_choice", "check_gradient", "check_hyperparameters"]


def _nonnegative(name: str, value: Any) -> list[tuple[str, str]]:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return [(name, f"must be a number, got {value!r}")]
    if not value >= 0.0:
        return [(name, f"must be >= 0, got {value!r}")]
    return []


def check_betas(value: Any, name: str = "betas") -> tuple[float, float]:
    """Validates a ``(beta1, beta2)`` pair, each in ``[0, 1)``.

    Args:
        value: The pair as given (a tuple or a JSON list).
        name: The argument name used in the error.

    Returns:
        The pair as a tuple of floats.

    Raises:
        ConfigError: Not two numbers in ``[0, 1)``.
    """
    if not isinstance(value, Sequence) or isinstance(value, str) or len(value) != 2:
        raise ConfigError.from_problems([(name, f"must be two numbers, got {value!r}")])
    for beta in value:
        if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not 0.0 <= beta < 1.0:
            raise ConfigError.from_problems(
                [(name, f"each beta must be a number in [0, 1), got {value!r}")]
            )
    return float(value[0]), float(value[1])


def check_hyperparameters(**values: Any) -> None:
    """Checks that every given value is a non-negative number.

    Args:
        **values: Argument name to value (``lr=1e-3, eps=1e-8``); ``None`` values are skipped.

    Raises:
        ConfigError: One problem per bad value.
    """
    problems = [p for name, v in values.items() if v is not None for p in _nonnegative(name, v)]
    if problems:
        raise ConfigError.from_problems(problems)


def check_choice(name: str, value: Any, choices: Sequence[str]) -> str:
    """Checks that ``value`` is one of ``choices``.

    Raises:
        ConfigError: The value is not one of them; the message lists them.
    """
    if value not in choices:
        known = ", ".join(repr(c) for c in choices)
        raise ConfigError.from_problems([(name, f"must be one of {known}, got {value!r}")])
    return str(value)


def check_gradient(param: torch.Tensor, grad: torch.Tensor, optimizer: str) -> None:
    """Refuses gradients no optimizer here can apply.

    Raises:
        ConfigError: A sparse gradient, or a gradient whose shape differs from the parameter's.
    """
    if grad.is_sparse:
        raise ConfigError(
            f"{optimizer} does not support sparse gradients; use torch.optim.SparseAdam for "
            "sparse embeddings, or build the embedding with sparse=False"
        )
    if grad.shape != param.shape:
        raise ConfigError(
            f"{optimizer}: a gradient of shape {tuple(grad.shape)} was found on a parameter "
            f"of shape {tuple(param.shape)}; the gradient must have the parameter's shape"
        )
