"""The token router of a mixture-of-experts layer, in fp32, as one function of the logits.

The algorithm, shared by Mixtral, Qwen-MoE and DeepSeek-V2/V3 (which differ only in knobs):

1. *Scores*: ``softmax`` or ``sigmoid`` of the router logits, computed in fp32 whatever the
   logits' dtype (a bf16 softmax over 64+ experts loses the order of close experts).
2. *Choice scores*: scores plus an optional per-expert correction bias (DeepSeek-V3's
   auxiliary-loss-free balancing, ``e_score_correction_bias``). The bias only steers *which*
   experts are chosen; it never enters the weights.
3. *Group-limited masking* (DeepSeek-V2/V3): the experts are split into ``num_groups``
   contiguous groups, each group is scored by ``group_score`` (``"top2_sum"``, the sum of its
   two best choice scores, as DeepSeek-V3; ``"max"``, its best one, as DeepSeek-V2's
   ``group_limited_greedy``), and every expert outside the ``limited_groups`` best groups is
   masked to ``-inf``.
4. *Top-k* on the (masked) choice scores gives the expert ids.
5. *Weights* are gathered from the unbiased scores of step 1; ``route_norm`` divides them by
   their sum, then they are multiplied by ``route_scale`` (DeepSeek-V3 normalises first and
   scales second, so normalised weights sum to ``route_scale``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from deepshard.interface.errors import ConfigError

__all__ = ["GroupScore", "Routing", "ScoreFunc", "route"]

ScoreFunc = Literal["softmax", "sigmoid"]
"""How router logits become per-expert scores."""

GroupScore = Literal["top2_sum", "max"]
"""How group-limited routing scores a group: its two best experts summed (DeepSeek-V3) or its
best one (DeepSeek-V2)."""

# Added to the normalising sum, as DeepSeek-V3 and Hugging Face do, so that all-zero sigmoid
# weights (every chosen logit at -inf) divide to zero instead of NaN.
_NORM_EPS = 1e-20


@dataclass(frozen=True)
class Routing:
    """Where each token goes and with what weight."""

    weights: torch.Tensor
    """``[T, K]`` fp32 routing weights, from the unbiased scores (normalised/scaled as asked)."""

    expert_ids: torch.Tensor
    """``[T, K]`` int64 chosen experts, best choice score first."""

    scores: torch.Tensor
    """``[T, E]`` fp32 unbiased scores of every expert (for auxiliary losses and statistics)."""


def route(
    logits: torch.Tensor,
    *,
    top_k: int,
    score_func: ScoreFunc,
    correction_bias: torch.Tensor | None = None,
    route_norm: bool,
    route_scale: float,
    num_groups: int | None = None,
    limited_groups: int | None = None,
    group_score: GroupScore = "top2_sum",
) -> Routing:
    """Routes tokens to experts (see the module docstring for the algorithm).

    Args:
        logits: ``[T, E]`` router logits (any float dtype; routing runs in fp32).
        top_k: Experts per token, ``1 <= top_k <= E``.
        score_func: ``"softmax"`` or ``"sigmoid"``.
        correction_bias: Optional ``[E]`` bias added to the scores for the choice only.
        route_norm: Divide the chosen weights by their sum.
        route_scale: Multiplier applied to the weights (after the normalisation).
        num_groups: Expert groups for group-limited routing; None or 1 disables it.
        limited_groups: Groups a token may choose from (required with ``num_groups > 1``).
        group_score: How a group is scored: ``"top2_sum"`` (DeepSeek-V3) or ``"max"``
            (DeepSeek-V2).

    Returns:
        The `Routing`: fp32 weights and int64 expert ids, both ``[T, K]``, and the scores.

    Raises:
        ConfigError: A knob does not fit the logits (top-k, groups, bias shape, score_func,
            group_score).
    """
    _check_route_args(logits, top_k, score_func, correction_bias, num_groups, limited_groups)
    if group_score not in ("top2_sum", "max"):
        raise ConfigError(f"route: group_score {group_score!r}: use top2_sum or max")
    logits32 = logits.float()
    scores = logits32.softmax(dim=-1) if score_func == "softmax" else logits32.sigmoid()
    choice = scores if correction_bias is None else scores + correction_bias.float()
    if num_groups is not None and num_groups > 1:
        assert limited_groups is not None  # checked above
        choice = _mask_to_best_groups(choice, num_groups, limited_groups, group_score)
    expert_ids = choice.topk(top_k, dim=-1).indices
    weights = scores.gather(-1, expert_ids)
    if route_norm:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + _NORM_EPS)
    if route_scale != 1.0:
        weights = weights * route_scale
    return Routing(weights=weights, expert_ids=expert_ids, scores=scores)


def _mask_to_best_groups(
    choice: torch.Tensor, num_groups: int, limited_groups: int, group_score: GroupScore
) -> torch.Tensor:
    """Sets every expert outside each token's ``limited_groups`` best groups to ``-inf``.

    A group's score is the sum of its two best choice scores (its best one when a group has a
    single expert), as DeepSeek-V3, or with ``group_score="max"`` its best choice score, as
    DeepSeek-V2. ``-inf`` (not ``0``, which DeepSeek-V2's softmax-only gate uses) guarantees
    that no masked expert is picked even when biased choice scores are negative.
    """
    tokens, experts = choice.shape
    grouped = choice.view(tokens, num_groups, experts // num_groups)
    best_in_group = 1 if group_score == "max" else min(2, experts // num_groups)
    group_scores = grouped.topk(best_in_group, dim=-1).values.sum(dim=-1)
    best_groups = group_scores.topk(limited_groups, dim=-1).indices
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(-1, best_groups, True)
    return grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(tokens, experts)


def _check_route_args(
    logits: torch.Tensor,
    top_k: int,
    score_func: str,
    correction_bias: torch.Tensor | None,
    num_groups: int | None,
    limited_groups: int | None,
) -> None:
    """Raises a `ConfigError` naming the ``expert_parallel`` key of the first bad argument."""
    if logits.dim() != 2:
        raise ConfigError(
            f"route: logits must be [tokens, experts], got shape {tuple(logits.shape)}"
        )
    experts = logits.shape[-1]
    problems: list[tuple[str, str]] = []
    if score_func not in ("softmax", "sigmoid"):
        problems.append(("expert_parallel.score_func", f"{score_func!r}: use softmax or sigmoid"))
    if not 1 <= top_k <= experts:
        problems.append(("expert_parallel.top_k", f"{top_k} must be in [1, {experts}] experts"))
    if correction_bias is not None and tuple(correction_bias.shape) != (experts,):
        shape = tuple(correction_bias.shape)
        problems.append(("e_score_correction_bias", f"shape {shape} must be ({experts},)"))
    if num_groups is not None and num_groups > 1:
        problems += _group_problems(experts, top_k, num_groups, limited_groups)
    if problems:
        raise ConfigError.from_problems(problems)


def _group_problems(
    experts: int, top_k: int, num_groups: int, limited_groups: int | None
) -> list[tuple[str, str]]:
    """Problems of the group-limited routing knobs for ``experts`` experts."""
    if experts % num_groups:
        message = f"{num_groups} does not divide the {experts} experts"
        return [("expert_parallel.num_expert_groups", message)]
    if limited_groups is None or not 1 <= limited_groups <= num_groups:
        message = f"{limited_groups} must be in [1, num_expert_groups={num_groups}]"
        return [("expert_parallel.num_limited_groups", message)]
    if limited_groups * (experts // num_groups) < top_k:
        message = f"{limited_groups} groups of {experts // num_groups} experts hold < top_k={top_k}"
        return [("expert_parallel.num_limited_groups", message)]
    return []
