"""Capacity, ``l_aux``, ``exp_counts`` and drops of the GShard gates, against hand computation.

The logits are fixed so every choice is known; softmax and the loss are recomputed with plain
Python ``math`` from the formulas in the module docstring.
"""

from __future__ import annotations

import math

import pytest
import torch

from deepshard.autoep import capacity, gshard_gating


def _softmax(row: list[float]) -> list[float]:
    exps = [math.exp(v) for v in row]
    return [e / sum(exps) for e in exps]


def _l_aux(logits: list[list[float]], counted: list[list[int]], divisor: int = 1) -> float:
    """``E · Σ_e mean_t(gates) · mean_t(mask) / divisor`` with the mask given as expert lists."""
    tokens, experts = len(logits), len(logits[0])
    gates = [_softmax(row) for row in logits]
    me = [sum(g[e] for g in gates) / tokens for e in range(experts)]
    ce = [sum(ids.count(e) for ids in counted) / tokens for e in range(experts)]
    return experts * sum(m * c for m, c in zip(me, ce, strict=True)) / divisor


@pytest.mark.parametrize(
    ("tokens", "experts", "factor", "floor", "expected"),
    [(10, 4, 1.0, 4, 4), (10, 4, 2.0, 1, 5), (64, 8, 1.25, 4, 10), (7, 7, 1.0, 0, 1)],
)
def test_capacity_is_the_ceiled_share_floored_at_min_capacity(
    tokens: int, experts: int, factor: float, floor: int, expected: int
) -> None:
    assert capacity(tokens, experts, factor, floor) == expected


def test_top1_drops_the_last_tokens_of_a_full_expert() -> None:
    # First choices 0, 0, 0, 0, 1, 2; capacity max(ceil(6/3 · 1), 2) = 2 keeps tokens 0 and 1.
    logits = [[3.0, 0, 0], [2, 1, 0], [1, 0, 0.5], [4, 1, 1], [0, 2, 1], [0, 1, 3]]
    gating = gshard_gating(
        torch.tensor(logits), k=1, capacity_factor=1.0, min_capacity=2, use_rts=False
    )
    assert gating.capacity == 2
    assert gating.expert_ids.squeeze(1).tolist() == [0, 0, 0, 0, 1, 2]
    assert gating.exp_counts.tolist() == [4, 1, 1]
    assert gating.kept.squeeze(1).tolist() == [True, True, False, False, True, True]
    chosen = [_softmax(row)[e] for row, e in zip(logits, [0, 0, 0, 0, 1, 2], strict=True)]
    expected = [w if keep else 0.0 for w, keep in zip(chosen, [1, 1, 0, 0, 1, 1], strict=True)]
    torch.testing.assert_close(gating.weights.squeeze(1), torch.tensor(expected))
    first = [[0], [0], [0], [0], [1], [2]]
    torch.testing.assert_close(gating.l_aux, torch.tensor(_l_aux(logits, first)))


def test_top2_keeps_first_choices_before_second_choices() -> None:
    # First / second choices: (0, 1), (0, 2), (1, 0), (0, 1); capacity ceil(4/3 · 0.5 · 2) = 2.
    # Expert 0 keeps t0, t1 (first choices) and drops t3's first and t2's second choice;
    # expert 1 keeps t2 (first) and t0 (second), drops t3's second; expert 2 keeps t1.
    logits = [[3.0, 2, 0], [3, 0, 1], [1, 2, 0], [2, 1, 0]]
    gating = gshard_gating(torch.tensor(logits), k=2, capacity_factor=0.5, min_capacity=0)
    assert gating.capacity == 2
    assert gating.expert_ids.tolist() == [[0, 1], [0, 2], [1, 0], [0, 1]]
    assert gating.exp_counts.tolist() == [4, 3, 1]
    assert gating.kept.tolist() == [[True, True], [True, True], [True, False], [False, False]]
    gates = [_softmax(row) for row in logits]
    expected = [
        [gates[0][0] / (gates[0][0] + gates[0][1]), gates[0][1] / (gates[0][0] + gates[0][1])],
        [gates[1][0] / (gates[1][0] + gates[1][2]), gates[1][2] / (gates[1][0] + gates[1][2])],
        [1.0, 0.0],  # the second choice was dropped: the first takes all the weight
        [0.0, 0.0],  # both dropped
    ]
    torch.testing.assert_close(gating.weights, torch.tensor(expected))
    first = [[0], [0], [1], [0]]
    torch.testing.assert_close(gating.l_aux, torch.tensor(_l_aux(logits, first)))


def test_top3_drops_the_routes_of_lowest_gate() -> None:
    # Top-3 of 4 experts for 4 tokens; capacity ceil(4/4 · 0.5 · 3) = 2 per expert.
    logits = [[4.0, 3, 2, 0], [0, 4, 3, 2], [3, 2, 0, 4], [2.5, 0, 4, 3]]
    gating = gshard_gating(torch.tensor(logits), k=3, capacity_factor=0.5, min_capacity=0)
    ids = [[0, 1, 2], [1, 2, 3], [3, 0, 1], [2, 3, 0]]
    assert gating.capacity == 2 and gating.expert_ids.tolist() == ids
    assert gating.exp_counts.tolist() == [3, 3, 3, 3]
    gates = [_softmax(row) for row in logits]
    # Per expert keep the 2 routes with the highest gate, computed here by sorting.
    kept = [[False] * 3 for _ in ids]
    for expert in range(4):
        routes = [(t, j) for t, row in enumerate(ids) for j, e in enumerate(row) if e == expert]
        for t, j in sorted(routes, key=lambda r: -gates[r[0]][ids[r[0]][r[1]]])[:2]:
            kept[t][j] = True
    assert gating.kept.tolist() == kept
    raw = [[gates[t][e] * kept[t][j] for j, e in enumerate(row)] for t, row in enumerate(ids)]
    expected = [[w / sum(row) for w in row] for row in raw]
    torch.testing.assert_close(gating.weights, torch.tensor(expected))
    torch.testing.assert_close(gating.l_aux, torch.tensor(_l_aux(logits, ids, divisor=3)))


@pytest.mark.parametrize("k", [1, 2, 3])
def test_drop_tokens_false_drops_nothing(k: int) -> None:
    logits = torch.randn(64, 4, generator=torch.Generator().manual_seed(k)) * 3
    gating = gshard_gating(logits, k=k, capacity_factor=0.1, min_capacity=0, drop_tokens=False)
    assert bool(gating.kept.all())
    assert gating.capacity == int(gating.exp_counts.max())
    torch.testing.assert_close(gating.weights.sum(-1), torch.ones(64)) if k > 1 else None
    dropping = gshard_gating(logits, k=k, capacity_factor=0.1, min_capacity=0, use_rts=False)
    assert not bool(dropping.kept.all())  # the same factor would drop with drop_tokens
