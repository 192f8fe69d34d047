"""Automatic tensor parallelism (AutoTP) for Hugging Face-style models.

A model's plan (`TPPlan`: one `LayerPlan` per module that TP touches, with its style and the
rows each rank holds) is chosen by `make_plan` from, in priority order, explicit
``partition_config`` layer specs and ``preset_model`` presets, the model's Hugging Face
``tp_plan``, and a structural heuristic; `describe_plan` prints it. Shard sizes follow the
model's KV-head groups (`AutoTPMeta`, read per model from its config) or a ``tp_grain_size``
grain. Planning is pure: it reads the model and returns data.
"""

from __future__ import annotations

from deepshard.autotp._defer import defer_grad_allreduce
from deepshard.autotp._describe import PLAN_ATTRIBUTE, describe_plan, plan_of
from deepshard.autotp._full_state import load_full_state_dict, save_full_state_dict
from deepshard.autotp._heuristic import ROW_LEAVES
from deepshard.autotp._hf_plan import TP_PLAN_STYLES, hf_tp_plan
from deepshard.autotp._layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    TPGroup,
    VocabParallelEmbedding,
)
from deepshard.autotp._meta import AutoTPMeta
from deepshard.autotp._parallelize import TPModelState, parallelize, tp_state
from deepshard.autotp._plan import make_plan
from deepshard.autotp._plan_types import LayerPlan, Style, TPPlan
from deepshard.autotp._presets import PRESETS, preset_specs
from deepshard.autotp._sizes import grain_split, kv_group_split, split_sizes, sub_parameter_sizes
from deepshard.autotp._warnings import AutoTPWarning

__all__ = [
    "PLAN_ATTRIBUTE",
    "PRESETS",
    "ROW_LEAVES",
    "TP_PLAN_STYLES",
    "AutoTPMeta",
    "AutoTPWarning",
    "ColumnParallelLinear",
    "LayerPlan",
    "RowParallelLinear",
    "Style",
    "TPGroup",
    "TPModelState",
    "TPPlan",
    "VocabParallelEmbedding",
    "defer_grad_allreduce",
    "describe_plan",
    "grain_split",
    "hf_tp_plan",
    "kv_group_split",
    "load_full_state_dict",
    "make_plan",
    "parallelize",
    "plan_of",
    "preset_specs",
    "save_full_state_dict",
    "split_sizes",
    "sub_parameter_sizes",
    "tp_state",
]
