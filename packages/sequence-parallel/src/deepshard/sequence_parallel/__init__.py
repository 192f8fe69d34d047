"""Ulysses sequence parallelism and tiled compute: train on sequences no single device holds.

``DistributedAttention(local_attention, mesh["sp"])`` exchanges q/k/v over the
sequence-parallel group (heads for sequence) around any local attention, with the exchange a
registered ``torch.library`` op (``deepshard_sp::all_to_all``) that ``torch.compile`` traces
and differentiates. ``plan_heads`` is the GQA-aware head split it uses.

``TiledMLP``, ``TiledFusedLogitsLoss`` and ``SequenceTiledCompute`` compute row-wise work a
slice of tokens at a time (recomputed in backward), cutting the MLP and logits activation
peaks; parameter gradients reach autograd once, after the last slice.

For Hugging Face models (ALST), ``apply_ulysses(model, parallel_dims)`` registers that
exchange as the model's attention, ``UlyssesDataLoaderAdapter`` gives each rank its sequence
shard, and the model's loss becomes ``sp_causal_lm_loss``, exact for any number of valid
tokens per shard (``sp_mean_loss`` for a custom loss); ``tile_hf_model`` switches a Llama/Qwen
model's MLP and logits-loss to the tiled ops.
"""

from __future__ import annotations

from deepshard.sequence_parallel._dataloader import UlyssesDataLoaderAdapter, shard_batch
from deepshard.sequence_parallel._heads import HeadPlan, plan_heads
from deepshard.sequence_parallel._hf import UlyssesAttention, apply_ulysses
from deepshard.sequence_parallel._hf_tiled import tile_hf_model
from deepshard.sequence_parallel._loss import sp_causal_lm_loss, sp_mean_loss, sum_over_group
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
    "UlyssesAttention",
    "UlyssesDataLoaderAdapter",
    "apply_ulysses",
    "plan_heads",
    "sequence_tiled_compute",
    "shard_batch",
    "sp_causal_lm_loss",
    "sp_mean_loss",
    "sum_over_group",
    "tile_hf_model",
    "tiled_fused_logits_loss",
    "tiled_mlp",
]
