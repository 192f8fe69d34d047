"""Which attention heads each sequence-parallel rank computes: the head plan.

Ulysses gives every rank the full sequence for a subset of heads. Under grouped-query attention
(GQA) query head `i` attends with KV head `i // group`, where `group = num_q_heads /
num_kv_heads` (the `repeat_interleave` order of `scaled_dot_product_attention(enable_gqa=True)`
and of Hugging Face's `repeat_kv`). Cutting the query heads without looking at the KV heads
would send a query head to a rank that does not hold its KV head, so the plan cuts KV heads
first and gives each rank the query heads of its KV heads:

* `num_kv_heads >= P`: KV heads are dealt in rank order as evenly as possible (the first
  `num_kv_heads % P` ranks get one more), each with its `group` query heads. Uneven counts are
  exchanged with variable all-to-all splits.
* `num_kv_heads < P` and `P % num_kv_heads == 0`: every KV head is repeated `P / num_kv_heads`
  times, so each rank gets one (replicated) KV head and an equal share of its query heads. The
  repeat is an autograd op, so the replicas' gradients are summed in backward.
* Anything else has no exact split, and is refused with the counts that would work.

The plan is a value computed from the counts of one call; it is never stored globally, so two
attention modules with different head counts cannot affect each other.
"""

from __future__ import annotations

from dataclasses import dataclass

from deepshard.interface.errors import ConfigError

__all__ = ["HeadPlan", "plan_heads"]


@dataclass(frozen=True)
class HeadPlan:
    """How the heads of one attention call are split over the ranks of a sequence group."""

    q_splits: tuple[int, ...]
    """Query heads computed by each group rank, in rank order (sums to the query head count)."""

    kv_splits: tuple[int, ...]
    """KV heads each group rank receives, after replication (sums to `num_kv_heads * kv_repeat`)."""

    kv_repeat: int
    """How many times each KV head is repeated before the exchange (1 unless KV heads < ranks)."""


def _even_splits(total: int, parts: int) -> list[int]:
    base, extra = divmod(total, parts)
    return [base + (1 if j < extra else 0) for j in range(parts)]


def plan_heads(num_q_heads: int, num_kv_heads: int, world_size: int) -> HeadPlan:
    """Split `num_q_heads` query and `num_kv_heads` KV heads over `world_size` ranks.

    Args:
        num_q_heads: Query heads of the layer (before sharding).
        num_kv_heads: KV heads of the layer (before sharding); equal to `num_q_heads` without
            GQA.
        world_size: Ranks in the sequence-parallel group.

    Returns:
        The per-rank query and KV head counts and the KV replication factor.

    Raises:
        ConfigError: If a count is not positive, the query heads are not a multiple of the KV
            heads, or no split keeps every query head with its KV head.
    """
    if num_q_heads < 1 or num_kv_heads < 1 or world_size < 1:
        raise ConfigError(
            f"head counts and the sequence-parallel size must be positive, got {num_q_heads} "
            f"query heads, {num_kv_heads} KV heads, {world_size} ranks."
        )
    if num_q_heads % num_kv_heads != 0:
        raise ConfigError(
            f"{num_q_heads} query heads are not a multiple of num_kv_heads={num_kv_heads}; pass "
            "the layer's KV head count (k.shape[2]) as num_kv_heads."
        )
    group = num_q_heads // num_kv_heads
    if num_kv_heads >= world_size:
        kv = _even_splits(num_kv_heads, world_size)
        return HeadPlan(tuple(n * group for n in kv), tuple(kv), 1)
    repeat = world_size // num_kv_heads
    if world_size % num_kv_heads != 0 or group % repeat != 0:
        raise ConfigError(
            f"{num_kv_heads} KV heads ({num_q_heads} query heads) cannot be split over "
            f"{world_size} sequence-parallel ranks: with fewer KV heads than ranks, the ranks "
            f"must be a multiple of the KV heads and each KV head's {group} query heads must "
            f"divide by that multiple. Use a sequence_parallel_size that divides "
            f"{num_kv_heads} or that {num_kv_heads} divides with {group} divisible by the quotient."
        )
    return HeadPlan((group // repeat,) * world_size, (1,) * world_size, repeat)
