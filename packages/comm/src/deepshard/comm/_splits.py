"""Checks of all-to-all split sizes, shared by the plain and the autograd all-to-all."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from deepshard.interface.errors import CommError

__all__ = ["a2a_output_rows", "check_split_sizes", "per_rank_splits"]


def per_rank_splits(splits: Sequence[int], group_size: int, name: str) -> list[int]:
    """`splits` as ints, one non-negative entry per group rank.

    Raises:
        CommError: On the wrong number of entries or a negative one.
    """
    out = [int(s) for s in splits]
    if len(out) != group_size or any(s < 0 for s in out):
        raise CommError(
            f"{name} must have one non-negative entry per group rank ({group_size}), got {out}."
        )
    return out


def check_split_sizes(
    splits: Sequence[int] | None, group_size: int, tensor: torch.Tensor, name: str
) -> list[int] | None:
    """Validate one side's split sizes against the group and the tensor they cut.

    Args:
        splits: Rows per group rank, or `None` for equal parts.
        group_size: Ranks in the group.
        tensor: The tensor the splits cut along dim 0.
        name: The argument's name, for the error message.

    Returns:
        The splits as a list of ints, or `None` when `splits` is `None`.

    Raises:
        CommError: If the splits have the wrong length, a negative entry, or a sum other than
            `tensor.shape[0]`, or (for `None`) dim 0 does not divide by the group size.
    """
    rows = tensor.shape[0] if tensor.dim() > 0 else 0
    if splits is None:
        if rows % group_size != 0:
            raise CommError(
                f"all_to_all with no {name} needs dim 0 ({rows}) divisible by the group size "
                f"{group_size}; pass {name} for uneven parts."
            )
        return None
    out = per_rank_splits(splits, group_size, name)
    if sum(out) != rows:
        raise CommError(f"{name} {out} sums to {sum(out)} but the tensor has {rows} rows in dim 0.")
    return out


def a2a_output_rows(
    input: torch.Tensor,
    group_size: int,
    output_split_sizes: Sequence[int] | None,
    input_split_sizes: Sequence[int] | None,
) -> int:
    """Rows of the output an all-to-all receives, when the caller did not give an output.

    Raises:
        CommError: If uneven input splits come without the output splits needed to size it, or
            the output splits have the wrong length or a negative entry.
    """
    if output_split_sizes is not None:
        return sum(per_rank_splits(output_split_sizes, group_size, "output_split_sizes"))
    if input_split_sizes is not None:
        raise CommError(
            "all_to_all with input_split_sizes but no output_split_sizes cannot size its output; "
            "pass output_split_sizes (rows received from each rank) or an output tensor."
        )
    return input.shape[0] if input.dim() > 0 else 0
