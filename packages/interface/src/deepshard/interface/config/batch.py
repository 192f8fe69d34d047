"""Batch-size reconciliation: ``train_batch_size = micro batch × accumulation steps × dp world``.

A DeepSpeed config may give any two or three of the batch numbers, or only ``train_batch_size``
or only ``train_micro_batch_size_per_gpu``; the rest are derived the way DeepSpeed derives them:

* all three given: they must satisfy the identity;
* two given: the third is the quotient (it must divide exactly);
* only the global batch: one accumulation step, micro batch = global batch / dp world;
* only the micro batch: one accumulation step, global batch = micro batch × dp world;
* neither the global nor the micro batch (at most the accumulation steps): an error.

The data-parallel world here counts the ranks that each read their own micro-batch
(`Topology.batch_world_size`: dp × ep; tensor- and sequence-parallel peers share samples).
"""

from __future__ import annotations

from dataclasses import dataclass

from deepshard.interface.errors import ConfigError

__all__ = ["BatchSizes", "resolve_batch_sizes"]

_TRAIN = "train_batch_size"
_MICRO = "train_micro_batch_size_per_gpu"
_ACCUM = "gradient_accumulation_steps"


@dataclass(frozen=True)
class BatchSizes:
    """The three reconciled batch numbers and the data-parallel world they were resolved for."""

    train_batch_size: int
    """Samples per optimizer step, summed over every data-parallel rank."""

    train_micro_batch_size_per_gpu: int
    """Samples per forward/backward pass on one rank."""

    gradient_accumulation_steps: int
    """Micro-batches accumulated on each rank before an optimizer step."""

    dp_world_size: int
    """Ranks that each read their own micro-batch."""


def _check_positive(name: str, value: int | None) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        message = f"expected a positive integer; got {value!r}"
        raise ConfigError(f"{name}: {message}", [(name, message)])
    if value <= 0:
        message = f"must be > 0; got {value}"
        raise ConfigError(f"{name}: {message}", [(name, message)])


def _divide(total: int, divisor: int, what: str, divisor_text: str) -> int:
    if total % divisor:
        message = (
            f"{_TRAIN} {total} is not divisible by {divisor_text} = {divisor}, so {what} "
            "would not be a whole number; change one of them"
        )
        raise ConfigError(message, [(_TRAIN, message)])
    return total // divisor


def _derive(train: int | None, micro: int | None, accum: int | None, dp: int) -> BatchSizes:
    if train is not None and micro is not None and accum is not None:
        return BatchSizes(train, micro, accum, dp)
    if train is not None and micro is not None:
        text = f"{_MICRO} {micro} × data-parallel world {dp}"
        return BatchSizes(train, micro, _divide(train, micro * dp, _ACCUM, text), dp)
    if train is not None and accum is not None:
        text = f"{_ACCUM} {accum} × data-parallel world {dp}"
        return BatchSizes(train, _divide(train, accum * dp, _MICRO, text), accum, dp)
    if micro is not None and accum is not None:
        return BatchSizes(micro * accum * dp, micro, accum, dp)
    if train is not None:
        text = f"data-parallel world {dp}"
        return BatchSizes(train, _divide(train, dp, _MICRO, text), 1, dp)
    if micro is not None:
        return BatchSizes(micro * dp, micro, 1, dp)
    message = f"give {_TRAIN} or {_MICRO} (or both); the missing batch numbers are derived"
    raise ConfigError(message, [(_TRAIN, message)])


def resolve_batch_sizes(
    train_batch_size: int | None,
    micro_batch_per_gpu: int | None,
    gradient_accumulation_steps: int | None,
    dp_world_size: int,
) -> BatchSizes:
    """Derives the missing batch numbers and checks that the three agree.

    Args:
        train_batch_size: Global batch per optimizer step, or ``None`` to derive it.
        micro_batch_per_gpu: Per-rank micro-batch, or ``None`` to derive it.
        gradient_accumulation_steps: Accumulation steps, or ``None`` to derive them.
        dp_world_size: Ranks that each read their own micro-batch.

    Returns:
        The reconciled batch sizes.

    Raises:
        ConfigError: A number is not a positive integer, neither batch size is given, a derived
            number would be fractional, or the three given numbers disagree.
    """
    _check_positive(_TRAIN, train_batch_size)
    _check_positive(_MICRO, micro_batch_per_gpu)
    _check_positive(_ACCUM, gradient_accumulation_steps)
    if isinstance(dp_world_size, bool) or not isinstance(dp_world_size, int) or dp_world_size < 1:
        raise ConfigError(f"dp_world_size must be a positive integer; got {dp_world_size!r}")
    sizes = _derive(
        train_batch_size, micro_batch_per_gpu, gradient_accumulation_steps, dp_world_size
    )
    product = (
        sizes.train_micro_batch_size_per_gpu * sizes.gradient_accumulation_steps * dp_world_size
    )
    if sizes.train_batch_size != product:
        message = (
            f"{_TRAIN} {sizes.train_batch_size} != {_MICRO} "
            f"{sizes.train_micro_batch_size_per_gpu} × {_ACCUM} "
            f"{sizes.gradient_accumulation_steps} × data-parallel world {dp_world_size} = {product}"
        )
        raise ConfigError(message, [(_TRAIN, message)])
    return sizes
