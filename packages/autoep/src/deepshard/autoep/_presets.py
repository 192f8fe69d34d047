"""Presets: how each Hugging Face MoE family lays out its block, and its routing knobs.

A preset names the block classes it recognises and the attributes inside a block: the router
(``gate``), the experts container, and the always-on shared experts with their optional gate.
The routing knobs are read from the router module itself (``top_k``, ``norm_topk_prob``,
``routed_scaling_factor``, ``num_group``/``topk_group``) because transformers keeps them there
for every family and nested configs (Qwen3.5's ``text_config``) then need no special case; the
``expert_parallel`` section overrides any of them. Checked against transformers 5 (fused
``gate_up_proj [E, 2I, H]`` / ``down_proj [E, H, I]`` experts; see `_replace`).

DeepSeek-V2 differs from V3 in its router only: softmax scores, no correction bias, no top-k
renormalisation (transformers' gate ignores ``norm_topk_prob``), and a ``topk_method`` of
``"greedy"`` (plain top-k, even when ``n_group`` is set) or ``"group_limited_greedy"`` (a group
is scored by its best expert, V3 by the sum of its best two).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from deepshard.autoep._router import GroupScore, ScoreFunc
from deepshard.interface.config.moe import ExpertParallelConfig
from deepshard.interface.errors import ConfigError

__all__ = ["PRESETS", "MoePreset", "RouterSettings", "find_preset", "router_settings"]


@dataclass(frozen=True)
class MoePreset:
    """The layout of one model family's MoE block."""

    name: str
    """The ``expert_parallel.preset_model`` value that selects it."""

    block_classes: tuple[str, ...]
    """Class names of the MoE blocks it replaces."""

    score_func: ScoreFunc
    """How router logits become scores."""

    route_norm: bool
    """Whether top-k weights are renormalised when the router has no ``norm_topk_prob``."""

    router_attr: str = "gate"
    """The router module inside the block (its output ``[0]`` is the logits)."""

    experts_attr: str = "experts"
    """The experts container (fused 3-D parameters or a ModuleList)."""

    shared_attr: str | None = None
    """Always-on shared experts added to the routed output."""

    shared_gate_attr: str | None = None
    """A ``[H -> 1]`` linear whose sigmoid scales the shared output (Qwen2/3.5-MoE)."""

    group_score: GroupScore = "top2_sum"
    """How group-limited routing scores a group (DeepSeek-V2: ``"max"``)."""


PRESETS: dict[str, MoePreset] = {
    p.name: p
    for p in (
        MoePreset("mixtral", ("MixtralSparseMoeBlock",), "softmax", route_norm=True),
        MoePreset("qwen3_moe", ("Qwen3MoeSparseMoeBlock",), "softmax", route_norm=False),
        MoePreset(
            "qwen2_moe",
            ("Qwen2MoeSparseMoeBlock", "Qwen3_5MoeSparseMoeBlock"),
            "softmax",
            route_norm=False,
            shared_attr="shared_expert",
            shared_gate_attr="shared_expert_gate",
        ),
        MoePreset(
            "deepseek_v3",
            ("DeepseekV3MoE",),
            "sigmoid",
            route_norm=True,
            shared_attr="shared_experts",
        ),
        MoePreset(
            "deepseek_v2",
            ("DeepseekV2Moe",),
            "softmax",
            route_norm=False,
            shared_attr="shared_experts",
            group_score="max",
        ),
    )
}
"""Every built-in preset by name (``qwen3_5_moe`` blocks use ``qwen2_moe``'s layout)."""

_TOPK_METHODS = ("greedy", "group_limited_greedy")
"""DeepSeek-V2 ``topk_method`` values transformers' gate implements (V3's router has none)."""


def find_preset(block: nn.Module, config: ExpertParallelConfig) -> MoePreset | None:
    """The preset that replaces ``block``, or None when it is not a MoE block.

    Raises:
        ConfigError: ``preset_model`` names no preset.
    """
    cls = type(block).__name__
    if config.preset_model is not None:
        if config.preset_model not in PRESETS:
            raise ConfigError(
                f"expert_parallel.preset_model: {config.preset_model!r} is not a preset; use "
                f"one of {', '.join(PRESETS)} or leave it unset to detect the model"
            )
        chosen = PRESETS[config.preset_model]
        return chosen if cls in chosen.block_classes else None
    for preset in PRESETS.values():
        if cls in preset.block_classes:
            return preset
    return None


@dataclass(frozen=True)
class RouterSettings:
    """The arguments of `route` for one MoE block."""

    top_k: int
    """Experts per token."""

    score_func: ScoreFunc
    """``softmax`` or ``sigmoid``."""

    route_norm: bool
    """Renormalise the top-k weights."""

    route_scale: float
    """Multiplier of the weights (DeepSeek's ``routed_scaling_factor`` × ``route_scale``)."""

    num_groups: int | None
    """Expert groups of group-limited routing (None: off)."""

    limited_groups: int | None
    """Groups a token may use."""

    group_score: GroupScore = "top2_sum"
    """How a group is scored (`route`'s ``group_score``)."""


def router_settings(
    router: nn.Module, preset: MoePreset, config: ExpertParallelConfig
) -> RouterSettings:
    """Reads the routing knobs from the HF router module, then applies the config's overrides.

    A DeepSeek router's ``topk_method`` of ``"greedy"`` turns group-limited routing off (its
    ``num_group`` is then unused), unless the config sets ``num_expert_groups``.

    Raises:
        ConfigError: The router has no ``top_k`` and the config does not give one, or its
            ``topk_method`` is not one DeepSeek defines.
    """
    top_k: Any = config.top_k if config.top_k != "auto" else getattr(router, "top_k", None)
    if not isinstance(top_k, int):
        raise ConfigError(
            f"expert_parallel.top_k: the router {type(router).__name__} has no top_k attribute; "
            "set expert_parallel.top_k"
        )
    scale = config.routed_scaling_factor
    if scale == "auto":
        scale = float(getattr(router, "routed_scaling_factor", 1.0) or 1.0)
    method = getattr(router, "topk_method", None)
    if method is not None and method not in _TOPK_METHODS:
        raise ConfigError(
            f"expert_parallel: the router {type(router).__name__} has topk_method {method!r}; "
            f"deepshard.autoep reproduces {', '.join(_TOPK_METHODS)}: fix the model config"
        )
    groups = config.num_expert_groups
    if groups is None and method != "greedy":
        groups = getattr(router, "num_group", None)
    limited = config.num_limited_groups or getattr(router, "topk_group", None)
    norm = config.route_norm
    if norm is None:
        norm = bool(getattr(router, "norm_topk_prob", preset.route_norm))
    return RouterSettings(
        top_k=top_k,
        score_func=preset.score_func if config.score_func == "auto" else config.score_func,
        route_norm=norm,
        route_scale=float(scale) * config.route_scale,
        num_groups=int(groups) if groups is not None else None,
        limited_groups=int(limited) if limited is not None else None,
        group_score=preset.group_score,
    )
