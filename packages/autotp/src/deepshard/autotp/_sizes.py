"""How many rows of a split dimension each TP rank holds: pure functions of sizes.

Two rules, chosen per sub-parameter:

- **KV-head groups.** An attention projection is cut between heads, never inside one, and a
  query head stays on the rank of the KV head it attends with. With ``g`` KV groups over ``t``
  ranks, rank ``r`` holds ``g // t + (1 if r < g % t else 0)`` whole groups, so a tensor of
  ``n`` rows gives rank ``r`` that many times ``n // g`` rows: 192 rows (3 KV heads of 64) on
  TP 2 is ``[128, 64]``, and a query projection of 12 heads in the same model follows as
  ``[512, 256]``. When ``t > g`` the trailing ranks hold nothing (their row-parallel partial
  sums are zero, so the result is still exact; the planner warns that attention stops scaling).
- **Grain.** Anything else (MLP, LM head, embedding, attention without known heads) is cut in
  whole grains of ``tp_grain_size`` rows, the extra grains going to the first ranks; a tail
  shorter than one grain goes to the last rank, so every other rank stays aligned. A split
  that would leave a rank with no rows at all is refused: it is a TP size too large for the
  layer.

A fused weight (``gate_up_proj``, a fused QKV) is several sub-parameters along the split
dimension, each split on its own by these rules (`sub_parameter_sizes`).
"""

from __future__ import annotations

from collections.abc import Sequence

from deepshard.interface.errors import ConfigError

__all__ = ["grain_split", "kv_group_split", "split_sizes", "sub_parameter_sizes"]

_TP_KEY = "tensor_parallel.autotp_size"


def _check_tp_size(tp_size: int) -> None:
    if tp_size < 1:
        raise ConfigError(
            f"{_TP_KEY}: {tp_size} ranks cannot hold a split; use 1 or more",
            [(_TP_KEY, "must be at least 1")],
        )


def kv_group_split(total: int, tp_size: int, groups: int) -> tuple[int, ...]:
    """Splits ``total`` rows made of ``groups`` equal KV-head groups over ``tp_size`` ranks.

    Args:
        total: Rows of the split dimension (a multiple of ``groups``).
        tp_size: Ranks in the TP group.
        groups: KV heads of the model; every group's rows stay on one rank.

    Returns:
        Rows per rank; trailing ranks hold 0 when ``tp_size > groups``.

    Raises:
        ConfigError: When ``total`` is not made of ``groups`` equal groups.
    """
    _check_tp_size(tp_size)
    if groups < 1 or total % groups:
        raise ConfigError(
            f"{total} rows cannot be cut into {groups} key/value-head groups; give a layer spec "
            "with the right 'shape' in tensor_parallel.partition_config.layer_specs",
            [("tensor_parallel.partition_config.layer_specs", "shape does not fit the heads")],
        )
    rows = total // groups
    return tuple((groups // tp_size + (rank < groups % tp_size)) * rows for rank in range(tp_size))


def grain_split(total: int, tp_size: int, grain: int = 1, *, name: str = "") -> tuple[int, ...]:
    """Splits ``total`` rows over ``tp_size`` ranks in whole grains of ``grain`` rows.

    Args:
        total: Rows of the split dimension.
        tp_size: Ranks in the TP group.
        grain: ``tensor_parallel.tp.tp_grain_size``; a tail shorter than one grain goes to
            the last rank.
        name: The module, for the error message.

    Returns:
        Rows per rank, the first ranks holding one grain more when the grains do not divide.

    Raises:
        ConfigError: When some rank would hold no rows (fewer grains than ranks).
    """
    _check_tp_size(tp_size)
    grains, tail = divmod(total, grain)
    if grains < tp_size:
        where = f" of {name!r}" if name else ""
        raise ConfigError(
            f"{_TP_KEY}: {tp_size} ranks cannot split the {total} rows{where} in grains of "
            f"{grain} (tensor_parallel.tp.tp_grain_size): some rank would hold nothing; lower "
            f"{_TP_KEY} or the grain, or leave the layer whole with a 'skip' layer spec",
            [(_TP_KEY, f"more ranks than grains{where}")],
        )
    sizes = [(grains // tp_size + (rank < grains % tp_size)) * grain for rank in range(tp_size)]
    sizes[-1] += tail
    return tuple(sizes)


def split_sizes(
    total: int, tp_size: int, *, kv_groups: int | None, grain: int = 1, name: str = ""
) -> tuple[int, ...]:
    """Rows per rank of one sub-parameter: by KV-head groups when they apply, else by grain.

    Args:
        total: Rows of the sub-parameter along the split dimension.
        tp_size: Ranks in the TP group.
        kv_groups: The model's KV heads when this is an attention tensor, else None. A tensor
            that is not a whole number of groups falls back to the grain.
        grain: ``tensor_parallel.tp.tp_grain_size``.
        name: The module, for error messages.

    Returns:
        Rows per rank, summing to ``total``.
    """
    if kv_groups is not None and total % kv_groups == 0:
        return kv_group_split(total, tp_size, kv_groups)
    return grain_split(total, tp_size, grain, name=name)


def sub_parameter_sizes(
    parts: Sequence[int],
    tp_size: int,
    *,
    kv_groups: Sequence[int | None],
    grain: int = 1,
    name: str = "",
) -> tuple[tuple[int, ...], ...]:
    """Per sub-parameter rows per rank: the `LayerPlan.sizes` of a fused weight.

    Args:
        parts: Each sub-parameter's rows, in order (``(q, k, v)``, or gate and up).
        tp_size: Ranks in the TP group.
        kv_groups: Per sub-parameter, the KV groups it follows (None: split by grain).
        grain: ``tensor_parallel.tp.tp_grain_size``.
        name: The module, for error messages.

    Returns:
        One tuple of per-rank rows for each sub-parameter.
    """
    return tuple(
        split_sizes(part, tp_size, kv_groups=groups, grain=grain, name=name)
        for part, groups in zip(parts, kv_groups, strict=True)
    )
