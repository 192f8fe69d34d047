"""Ulysses sequence parallelism and tiled compute: train on sequences no single device holds.

``DistributedAttention(local_attention, mesh["sp"])`` exchanges q/k/v over the
sequence-parallel group (heads for sequence) around any local attention, with the exchange a
registered ``torch.library`` op (``deepshard_sp::all_to_all``) that ``torch.compile`` traces
and differentiates. ``plan_heads`` is the GQA-aware head split it uses.

``TiledMLP``, ``TiledFusedLogitsLoss`` and ``SequenceTiledCompute`` compute row-wise work a
slice of tokens at a time (recomputed in backward), cutting the MLP and logits activation
peaks; parameter gradients reach autograd once, after the last slice.
"""

from __future__ import annotations

from deepshard.sequence_parallel._heads import HeadPlan, plan_heads
from deepshard.sequence_parallel.attention import DistributedAttention
from deepshard.sequence_parallel.sequence_tiled import SequenceTiledCompute, sequence_tiled_compute
from deepshard.sequence_parallel.tiled import (
    TiledFusedLogitsLoss,
    TiledMLP,
    tiled_fused_logits_loss,
    tiled_mlp,
)

__all__ = [
    "DistributedAttention",
    "HeadPlan",
    "SequenceTiledCompute",
    "TiledFusedLogitsLoss",
    "TiledMLP",
    "plan_heads",
    "sequence_tiled_compute",
    "tiled_fused_logits_loss",
    "tiled_mlp",
]
