"""Ulysses sequence parallelism and tiled compute: train on sequences no single device holds.

``DistributedAttention(local_attention, mesh["sp"])`` exchanges q/k/v over the
sequence-parallel group (heads for sequence) around any local attention, with the exchange a
registered ``torch.library`` op (``deepshard_sp::all_to_all``) that ``torch.compile`` traces
and differentiates. ``plan_heads`` is the GQA-aware head split it uses.
"""

from __future__ import annotations

from deepshard.sequence_parallel._heads import HeadPlan, plan_heads
from deepshard.sequence_parallel.attention import DistributedAttention

__all__ = ["DistributedAttention", "HeadPlan", "plan_heads"]
