"""Mixture-of-experts for DeepShard: routing, combining, expert parallelism, the classic MoE layer.

- ``route(logits, top_k=..., score_func=..., ...)`` is the fp32 router of Mixtral, Qwen-MoE and
  DeepSeek-V2/V3 (softmax or sigmoid scores, a correction bias that steers the choice but not
  the weights, group-limited routing scoring a group by its best two experts or its best one,
  ``route_norm`` / ``route_scale``) as one function.
- ``sort_by_expert`` puts routes in expert-contiguous order; ``weighted_sum`` (the reference)
  or deepshard-kernels' ``fused_weighted_sum`` (via ``combine``) restores token order with the
  routing weights, summing in fp32.
- ``parallelize_experts(model, mesh)`` replaces a Hugging Face MoE model's blocks with
  expert-parallel ones (each rank keeps ``E / ep`` experts; tokens travel by all-to-all) and
  returns a `ReplacementReport` with every parameter's placement and the experts' shard maps;
  ``remap_optimizer`` moves an optimizer built before the replacement onto the new parameters.
  Routing weights scale the expert outputs at the combine (``score_apply`` post, the default)
  or the dispatched input rows before the expert GEMMs (``score_apply: "pre"``).
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
from deepshard.autoep._dispatch import AllToAllTransport
from deepshard.autoep._ep_layer import ExpertParallelBlock
from deepshard.autoep._gating import Gating, capacity, gshard_gating
from deepshard.autoep._grouped_experts import GroupedExperts
from deepshard.autoep._moe import MoE
from deepshard.autoep._presets import PRESETS, MoePreset
from deepshard.autoep._remap import remap_optimizer
from deepshard.autoep._replace import parallelize_experts
from deepshard.autoep._report import ParamSwap, ReplacedBlock, ReplacementReport
from deepshard.autoep._router import GroupScore, Routing, ScoreFunc, route

__all__ = [
    "PRESETS",
    "AllToAllTransport",
    "CombineImpl",
    "ExpertOrder",
    "ExpertParallelBlock",
    "Gating",
    "GroupScore",
    "GroupedExperts",
    "MoE",
    "MoePreset",
    "ParamSwap",
    "ReplacedBlock",
    "ReplacementReport",
    "Routing",
    "ScoreFunc",
    "capacity",
    "combine",
    "gshard_gating",
    "parallelize_experts",
    "remap_optimizer",
    "route",
    "sort_by_expert",
    "weighted_sum",
]
