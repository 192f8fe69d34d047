"""Sorting routed tokens by expert and combining the experts' rows back into tokens.

A MoE layer with ``T`` tokens and ``K`` choices per token has ``T·K`` routes. Grouped expert
GEMMs want the routes expert-contiguous, so the routes are stably sorted by expert id
(`sort_by_expert`); the experts then produce one row per route in that order, and the combine
restores token order and weights each route by its routing weight:

    out[t] = sum_k weights[t, k] * rows[index[t, k]]

where ``index`` is the inverse of the sort permutation. `weighted_sum` is the readable reference
(gather, multiply, sum over ``K`` in fp32); `combine` picks it or deepshard-kernels'
``fused_weighted_sum`` (the same sum as one op, with its own backward).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from deepshard.interface.errors import ConfigError
from deepshard.kernels import fused_weighted_sum

__all__ = ["CombineImpl", "ExpertOrder", "combine", "sort_by_expert", "weighted_sum"]

CombineImpl = Literal["weighted_sum", "fused_weighted_sum"]
"""How expert rows are combined into token rows."""


@dataclass(frozen=True)
class ExpertOrder:
    """The routes of a batch in expert-contiguous order."""

    token_of_row: torch.Tensor
    """``[T·K]`` int64: the token each sorted row comes from (gather the inputs with it)."""

    index: torch.Tensor
    """``[T, K]`` int64: the sorted row of each (token, choice), the inverse permutation."""

    counts: torch.Tensor
    """``[E]`` int64: rows per expert, in expert order (the grouped GEMM's group sizes)."""


def sort_by_expert(expert_ids: torch.Tensor, num_experts: int) -> ExpertOrder:
    """Stably sorts the ``[T, K]`` routes by expert, keeping token order within each expert.

    Args:
        expert_ids: ``[T, K]`` integer expert of each route, in ``[0, num_experts)``.
        num_experts: Number of experts (ids at ``num_experts`` or above are refused).

    Returns:
        The `ExpertOrder`.

    Raises:
        ConfigError: An expert id is outside ``[0, num_experts)``.
    """
    flat = expert_ids.reshape(-1).long()
    # Reading the ids is a device sync on an accelerator, so the negative check runs on CPU only;
    # bincount's length catches ids that are too large everywhere.
    negative = flat.device.type == "cpu" and flat.numel() > 0 and int(flat.min()) < 0
    counts = torch.bincount(flat.clamp(min=0), minlength=num_experts)
    if negative or counts.numel() != num_experts:
        raise ConfigError(
            f"sort_by_expert: expert ids must be in [0, {num_experts}) (num_experts); got ids "
            f"up to {counts.numel() - 1}{' and negative ones' if negative else ''}"
        )
    order = flat.argsort(stable=True)
    index = torch.empty_like(order)
    index[order] = torch.arange(order.numel(), device=order.device)
    k = expert_ids.shape[-1]
    return ExpertOrder(token_of_row=order // k, index=index.view(expert_ids.shape), counts=counts)


def weighted_sum(rows: torch.Tensor, weights: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """The reference combine: ``out[t] = sum_k weights[t, k] * rows[index[t, k]]``, in fp32.

    Args:
        rows: ``[N, H]`` expert outputs in sorted order (``N >= T·K``; extra rows unread).
        weights: ``[T, K]`` routing weights.
        index: ``[T, K]`` row of each (token, choice), from `sort_by_expert`.

    Returns:
        ``[T, H]`` in ``rows.dtype``, summed in fp32.
    """
    tokens, k = index.shape
    restored = rows.index_select(0, index.reshape(-1)).view(tokens, k, rows.shape[-1])
    return (restored.float() * weights.float().unsqueeze(-1)).sum(dim=1).to(rows.dtype)


def combine(
    rows: torch.Tensor, weights: torch.Tensor, index: torch.Tensor, *, impl: CombineImpl
) -> torch.Tensor:
    """Combines expert rows into token rows with ``impl`` (both give the same sum).

    Raises:
        ConfigError: ``impl`` is not one of `CombineImpl`.
    """
    if impl == "weighted_sum":
        return weighted_sum(rows, weights, index)
    if impl == "fused_weighted_sum":
        return fused_weighted_sum(rows, weights, index)
    raise ConfigError(
        f"expert_parallel.combine_impl: {impl!r}: use weighted_sum or fused_weighted_sum"
    )
