"""Mixture-of-experts for DeepShard: routing, combining and the classic MoE layer.

``route(logits, top_k=..., score_func=..., ...)`` is the fp32 router of Mixtral, Qwen-MoE and
DeepSeek-V2/V3 (softmax or sigmoid scores, a correction bias that steers the choice but not the
weights, group-limited routing, ``route_norm`` / ``route_scale``) as one function of the logits.
"""

from __future__ import annotations

from deepshard.autoep._router import Routing, ScoreFunc, route

__all__ = ["Routing", "ScoreFunc", "route"]
