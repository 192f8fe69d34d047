"""Mixture-of-experts for DeepShard: routing, combining and the classic MoE layer.

- ``route(logits, top_k=..., score_func=..., ...)`` is the fp32 router of Mixtral, Qwen-MoE and
  DeepSeek-V2/V3 (softmax or sigmoid scores, a correction bias that steers the choice but not
  the weights, group-limited routing, ``route_norm`` / ``route_scale``) as one function.
- ``sort_by_expert`` puts routes in expert-contiguous order; ``weighted_sum`` (the reference)
  or deepshard-kernels' ``fused_weighted_sum`` (via ``combine``) restores token order with the
  routing weights, summing in fp32.
- ``MoE(hidden_size, expert, num_experts, k=...)`` is DeepSpeed's classic layer (GShard top-1 /
  top-2 / top-k gating, capacity, auxiliary loss) returning ``(output, l_aux, exp_counts)``;
  ``gshard_gating`` and ``capacity`` are its gate as functions.
"""

from __future__ import annotations

from deepshard.autoep._combine import (
    CombineImpl,
    ExpertOrder,
    combine,
    sort_by_expert,
    weighted_sum,
)
from deepshard.autoep._gating import Gating, capacity, gshard_gating
from deepshard.autoep._moe import MoE
from deepshard.autoep._router import Routing, ScoreFunc, route

__all__ = [
    "CombineImpl",
    "ExpertOrder",
    "Gating",
    "MoE",
    "Routing",
    "ScoreFunc",
    "capacity",
    "combine",
    "gshard_gating",
    "route",
    "sort_by_expert",
    "weighted_sum",
]
