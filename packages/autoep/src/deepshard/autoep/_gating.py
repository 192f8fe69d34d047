"""GShard-style gating of the classic MoE layer (DeepSpeed's top-1 / top-2 / top-k), as functions.

Every variant starts from ``gates = softmax(logits)`` in fp32 over ``E`` experts for ``T``
tokens and returns, per token, ``K`` expert ids and combine weights, the auxiliary
load-balancing loss and the per-expert counts:

- **Choice.** Top-1: the best gate (or, with ``RSample`` noise while training, the best of
  ``logits + Gumbel``). Top-2: the best gate, then the best of the remaining logits (plus Gumbel
  noise while training with ``second_expert_sampling``). Top-k: the ``k`` best gates.
- **Counts.** ``exp_counts[e]`` counts every route to ``e`` *before* capacity drops.
- **Auxiliary loss.** With ``me = mean_t gates`` and ``ce = mean_t first-choice mask``:
  ``l_aux = E · sum_e me·ce`` for top-1 and top-2; for top-k the mask counts all ``k`` choices
  and ``l_aux = E · sum_e me·ce / k``. (DeepSpeed writes top-2's as ``mean(me·ce)·E²``.)
- **Capacity.** ``capacity(T, E, f·k, min_capacity) = max(ceil(T / E · f·k), min_capacity)``
  with ``f`` the (train or eval) capacity factor; ``k`` multiplies it for top-2 and top-k.
  Without ``drop_tokens`` the capacity is the largest count, so nothing is dropped.
- **Who is dropped.** Routes beyond an expert's capacity, in priority order: top-1 keeps the
  first tokens (or, with ``use_rts``, a random subset); top-2 keeps every token's first choice
  before any second choice, each by position; top-k keeps the routes of highest gate.
- **Weights.** Top-1: the chosen gate itself (0 when dropped). Top-2 and top-k: the kept gates
  renormalised to sum to one per token (divided by at least fp32 eps).

Deliberate differences from DeepSpeed 0.19.7: top-2's second-expert sampling is off in eval
(DeepSpeed samples at inference too, so two evaluations differ), top-1 has no
``tokens >= min_capacity`` assertion, and ties in top-1's drop without ``use_rts`` keep the
earlier token (DeepSpeed leaves them to ``topk``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

__all__ = ["Gating", "capacity", "gshard_gating"]


@dataclass(frozen=True)
class Gating:
    """What a gate decided for one batch of tokens."""

    expert_ids: torch.Tensor
    """``[T, K]`` int64 chosen experts (dropped routes keep their expert, with weight 0)."""

    weights: torch.Tensor
    """``[T, K]`` fp32 combine weights, 0 for dropped routes."""

    kept: torch.Tensor
    """``[T, K]`` bool: the route fits in its expert's capacity."""

    l_aux: torch.Tensor
    """Scalar fp32 auxiliary load-balancing loss (differentiable in the logits)."""

    exp_counts: torch.Tensor
    """``[E]`` int64 routes per expert before capacity drops (detached)."""

    capacity: int
    """Routes an expert accepts in this batch."""


def capacity(tokens: int, experts: int, factor: float, min_capacity: int) -> int:
    """``max(ceil(tokens / experts · factor), min_capacity)``: an expert's share of the routes."""
    return max(math.ceil(tokens / experts * factor), min_capacity)


def gshard_gating(
    logits: torch.Tensor,
    *,
    k: int,
    capacity_factor: float,
    min_capacity: int,
    drop_tokens: bool = True,
    use_rts: bool = True,
    rsample: bool = False,
    second_expert_sampling: bool = False,
) -> Gating:
    """Routes ``[T, E]`` logits as DeepSpeed's gates (see the module docstring).

    Args:
        logits: ``[T, E]`` gate logits (routed in fp32).
        k: Experts per token (1, 2, or more).
        capacity_factor: The capacity factor in force (train or eval).
        min_capacity: Fewest routes an expert accepts.
        drop_tokens: Drop routes beyond capacity; False sizes the capacity to fit them all.
        use_rts: Top-1: drop a random subset of an over-full expert's tokens (else the last).
        rsample: Top-1: choose by ``logits + Gumbel`` noise (the ``RSample`` policy, training).
        second_expert_sampling: Top-2: add Gumbel noise to the logits for the second choice.

    Returns:
        The `Gating`.
    """
    logits = logits.float()
    tokens, experts = logits.shape
    gates = logits.softmax(dim=-1)
    expert_ids = _choose(logits, gates, k, rsample, second_expert_sampling)
    counts = torch.bincount(expert_ids.reshape(-1), minlength=experts)
    first = F.one_hot(expert_ids if k > 2 else expert_ids[:, 0], experts).float()
    if k > 2:
        first = first.sum(dim=1)
    l_aux = (gates.mean(dim=0) * first.mean(dim=0)).sum() * experts / (k if k > 2 else 1)
    if drop_tokens:
        cap = capacity(tokens, experts, capacity_factor * k, min_capacity)
    else:
        cap = int(counts.max())
    kept = _keep_within_capacity(expert_ids, _priority(gates, expert_ids, use_rts), cap)
    weights = gates.gather(1, expert_ids) * kept
    if k > 1:
        weights = weights / weights.sum(dim=-1, keepdim=True).clamp(
            min=torch.finfo(torch.float32).eps
        )
    return Gating(expert_ids, weights, kept, l_aux, counts.detach(), cap)


def _choose(
    logits: torch.Tensor, gates: torch.Tensor, k: int, rsample: bool, sampling: bool
) -> torch.Tensor:
    """``[T, K]`` expert ids, best first."""
    if k == 1:
        source = logits + _gumbel(logits) if rsample else gates
        return source.argmax(dim=-1, keepdim=True)
    if k == 2:
        first = gates.argmax(dim=-1, keepdim=True)
        noisy = logits + _gumbel(logits) if sampling else logits
        second = noisy.scatter(1, first, float("-inf")).argmax(dim=-1, keepdim=True)
        return torch.cat([first, second], dim=1)
    return gates.topk(k, dim=-1).indices


def _priority(gates: torch.Tensor, expert_ids: torch.Tensor, use_rts: bool) -> torch.Tensor:
    """``[T, K]`` sort key of each route within its expert: lower keys are kept first."""
    tokens, k = expert_ids.shape
    if k == 1:
        if use_rts:
            return torch.rand(tokens, 1, device=gates.device)
        return torch.arange(tokens, device=gates.device, dtype=torch.float32).unsqueeze(1)
    if k == 2:
        position = torch.arange(tokens, device=gates.device, dtype=torch.float32)
        return torch.stack([position, position + tokens], dim=1)
    return -gates.gather(1, expert_ids)


def _keep_within_capacity(expert_ids: torch.Tensor, key: torch.Tensor, cap: int) -> torch.Tensor:
    """``[T, K]`` bool: whether each route ranks below ``cap`` among its expert's routes by key."""
    flat_ids, flat_key = expert_ids.reshape(-1), key.reshape(-1)
    by_key = flat_key.argsort(stable=True)
    order = by_key[flat_ids[by_key].argsort(stable=True)]  # by expert, then by key
    counts = torch.bincount(flat_ids)
    starts = counts.cumsum(0) - counts
    rank = torch.empty_like(order)
    rank[order] = torch.arange(order.numel(), device=order.device) - starts[flat_ids[order]]
    return (rank < cap).view(expert_ids.shape)


def _gumbel(like: torch.Tensor) -> torch.Tensor:
    """Standard Gumbel noise shaped like ``like``, from torch's default generator."""
    uniform = torch.rand_like(like).clamp(min=torch.finfo(like.dtype).tiny)
    return -torch.log(-torch.log(uniform))
