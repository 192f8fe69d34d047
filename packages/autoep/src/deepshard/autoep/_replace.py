"""`parallelize_experts`: replace a model's MoE blocks with expert-parallel ones.

For every block a preset recognises (`_presets`), in module order:

1. the experts are read in either layout: transformers 5's fused 3-D parameters
   (``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``) or a ``ModuleList`` of gated MLPs
   (``gate_proj``/``up_proj``/``down_proj`` linears, or the names ``expert_w1``/``expert_w3``/
   ``expert_w2`` give), which are stacked into the fused layout;
2. this rank keeps experts ``[r·E/ep, (r+1)·E/ep)`` (``r`` its ``ep`` coordinate) as fresh,
   16-byte aligned parameters; the full tensors are dropped;
3. the score-correction bias (DeepSeek-V3's ``e_score_correction_bias``) is found wherever it
   lives in the block; it is never copied: in a child it stays where it is, on the block it is
   re-registered on the new block as the same object with the same kind (Parameter or
   buffer) and persistence. Two candidates are refused, since either could be the one the
   router reads;
4. the block is swapped for an `ExpertParallelBlock` in its parent.

Placements (interface) are then written for every parameter of the model: expert parameters
``Shard(0)`` on ``ep`` with their global shape, reduced over ``dp``; all others replicated and
reduced over ``dp × ep × sp``. Each expert parameter also gets its `ShardMap` over ``ep``.

*Expert tensor parallelism* (``expert_tensor_parallel_size`` = the mesh's ``tp``, with AutoTP
splitting the dense layers over the same ranks): every ``tp`` rank of an ``ep`` group sees the
same tokens and routing, so each local expert is split over ``tp`` Megatron-style (`_tp_slices`:
``gate_up`` keeps its slice of the gate rows and of the up rows, ``down`` the matching columns).
The block enters the received rows through `deepshard.comm.copy_to_group` (their gradient is
summed over ``tp``) and sums the expert outputs over ``tp`` (`reduce_from_group`) *before* the
weighted combine, so the routing weights and everything after see whole outputs. The stacks'
placements add the ``tp`` split (``Shard(1, (I, I))`` for ``gate_up``: two boxes per expert;
``Shard(2)`` for ``down``) and their maps span ``ep × tp``.

*A model that is partitioned already* (built under ``deepshard.zero.Init``: every ``.data``
is an empty slice) is replaced through a `deepshard.interface.PartitionedParams` the caller
passes (the engine's is ``deepshard.zero.Repartition``): step 1-2 run inside
``partitioned.gathered(<the block's expert parameters>)``, so only that block's experts are
whole, and the two new stacks are handed to ``partitioned.partition(..., expert=True)``
before the next block is read; full shapes for the placements come from
``partitioned.full_shape``.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from deepshard.autoep._combine import CombineImpl
from deepshard.autoep._dispatch import AllToAllTransport
from deepshard.autoep._ep_layer import ExpertParallelBlock
from deepshard.autoep._expert_placements import expert_placements
from deepshard.autoep._grouped_experts import GroupedExperts, aligned_expert_weight
from deepshard.autoep._presets import PRESETS, MoePreset, find_preset, router_settings
from deepshard.autoep._remap import remap_optimizer
from deepshard.autoep._report import ParamSwap, ReplacedBlock, ReplacementReport
from deepshard.comm import ParallelDims, mark_collective_forward
from deepshard.interface import (
    PartitionedParams,
    Topology,
)
from deepshard.interface.config.moe import ExpertParallelConfig
from deepshard.interface.errors import ConfigError

__all__ = ["parallelize_experts"]

_ETP = "expert_parallel.expert_tensor_parallel_size"
_BIAS_NAME = re.compile(r"(^|\.)e_score_correction_bias$")
_MLP_NAMES = (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"))


def _dims_of(mesh_or_parallel_dims: DeviceMesh | ParallelDims) -> ParallelDims:
    if isinstance(mesh_or_parallel_dims, ParallelDims):
        return mesh_or_parallel_dims
    if isinstance(mesh_or_parallel_dims, DeviceMesh):
        return ParallelDims.from_mesh(mesh_or_parallel_dims)
    raise ConfigError(
        "parallelize_experts: pass the mesh from deepshard.comm.build_mesh(topology) or a "
        f"deepshard.comm.ParallelDims, not {type(mesh_or_parallel_dims).__name__}"
    )


def _section(config: ExpertParallelConfig | None, topology: Topology) -> ExpertParallelConfig:
    if config is None or not config.enabled:
        # Calling parallelize_experts is the request; the mesh says the degree.
        base = config or ExpertParallelConfig()
        config = base.model_copy(update={"enabled": True, "autoep_size": topology.ep})
    if config.autoep_size != topology.ep:
        raise ConfigError(
            f"expert_parallel.autoep_size: {config.autoep_size} differs from the mesh's ep "
            f"axis {topology.ep}; build the mesh with Topology(ep={config.autoep_size}, ...)"
        )
    etp = config.expert_tensor_parallel_size
    if etp > 1 and etp != topology.tp:
        raise ConfigError(
            f"expert_parallel.expert_tensor_parallel_size: {etp} differs from the mesh's tp "
            f"axis {topology.tp}; experts are split over the same tp ranks as the dense layers "
            f"(tensor_parallel.autotp_size = {etp}), or set it to 1 (experts whole on every "
            "tp rank)",
            [(_ETP, f"{etp} != tp {topology.tp}")],
        )
    return config


def _correction_bias(block: nn.Module, name: str) -> str | None:
    """The block-relative path of its score-correction bias (one candidate at most)."""
    found = [n for n, _ in block.named_parameters() if _BIAS_NAME.search(n)]
    found += [n for n, _ in block.named_buffers() if _BIAS_NAME.search(n)]
    if len(found) > 1:
        raise ConfigError(
            f"{name}: {len(found)} score-correction biases {found}; the router reads one, so "
            "remove the stale ones before parallelize_experts"
        )
    return found[0] if found else None


def _mlp_names(config: ExpertParallelConfig) -> Sequence[tuple[str, str, str]]:
    names = (config.expert_w1, config.expert_w3, config.expert_w2)
    if not any(names):
        return _MLP_NAMES
    if not all(names):
        raise ConfigError(
            "expert_parallel.expert_w1/expert_w3/expert_w2: give all three linear names (gate, "
            "up, down); experts without a gate projection are not supported"
        )
    return ((str(names[0]), str(names[1]), str(names[2])),)


def _experts_layout(
    experts: nn.Module, name: str, config: ExpertParallelConfig
) -> tuple[str, list[nn.Parameter], list[nn.Parameter], Callable[..., torch.Tensor]]:
    """``(layout, gate_up sources, down sources, act_fn)`` of an experts container."""
    gate_up, down = getattr(experts, "gate_up_proj", None), getattr(experts, "down_proj", None)
    if isinstance(gate_up, nn.Parameter) and isinstance(down, nn.Parameter) and gate_up.dim() == 3:
        return "fused", [gate_up], [down], _act_fn(experts, name)
    if isinstance(experts, nn.ModuleList) and len(experts) > 0:
        for g, u, d in _mlp_names(config):
            if all(isinstance(getattr(e, a, None), nn.Linear) for e in experts for a in (g, u, d)):
                ups = [w for e in experts for w in (getattr(e, g).weight, getattr(e, u).weight)]
                downs = [getattr(e, d).weight for e in experts]
                return "module_list", ups, downs, _act_fn(experts[0], name)
    raise ConfigError(
        f"{name}: experts are neither fused 3-D gate_up_proj/down_proj parameters nor a "
        "ModuleList of gated MLPs (gate_proj/up_proj/down_proj); set expert_parallel.expert_w1/"
        "expert_w3/expert_w2 to the linear names"
    )


def _act_fn(module: nn.Module, name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    act = getattr(module, "act_fn", None)
    if not callable(act):
        raise ConfigError(
            f"{name}: the experts have no act_fn (the gate activation); give the expert module "
            "an act_fn attribute (e.g. torch.nn.SiLU())"
        )
    return act  # type: ignore[no-any-return]


def _local_weights(
    layout: str, gate_up: list[nn.Parameter], down: list[nn.Parameter], lo: int, hi: int
) -> tuple[Callable[[Sequence[torch.Tensor]], torch.Tensor], ...]:
    """``derive`` functions building the local ``[hi-lo, ...]`` stacks from the sources."""
    if layout == "fused":
        return (lambda ts: ts[0][lo:hi], lambda ts: ts[0][lo:hi])

    def stack_gate_up(ts: Sequence[torch.Tensor]) -> torch.Tensor:
        return torch.stack([torch.cat([ts[2 * e], ts[2 * e + 1]]) for e in range(lo, hi)])

    def stack_down(ts: Sequence[torch.Tensor]) -> torch.Tensor:
        return torch.stack([ts[e] for e in range(lo, hi)])

    return (stack_gate_up, stack_down)


def _tp_slices(
    derive_gate_up: Callable[[Sequence[torch.Tensor]], torch.Tensor],
    derive_down: Callable[[Sequence[torch.Tensor]], torch.Tensor],
    intermediate: int,
    dims: ParallelDims,
    name: str,
) -> tuple[Callable[[Sequence[torch.Tensor]], torch.Tensor], ...]:
    """The local stacks cut to this rank's ``tp`` slice of every expert (expert TP).

    Each expert is split Megatron-style: ``gate_up`` keeps rows ``[t·w, (t+1)·w)`` of the gate
    half and the same rows of the up half, back to back (so the local ``chunk(2)`` still gives
    gate and up), ``down`` the columns ``[t·w, (t+1)·w)``; ``w = I / tp``.
    """
    tp, t = dims.topology.tp, dims.coordinate["tp"]
    if intermediate % tp:
        raise ConfigError(
            f"expert_parallel.expert_tensor_parallel_size: {name}'s experts have an "
            f"intermediate size of {intermediate}, which {tp} tensor-parallel ranks cannot "
            "split evenly; choose a size that divides it, or 1",
            [
                (
                    "expert_parallel.expert_tensor_parallel_size",
                    f"{tp} does not divide {intermediate}",
                )
            ],
        )
    w = intermediate // tp

    def gate_up_slice(ts: Sequence[torch.Tensor]) -> torch.Tensor:
        stack = derive_gate_up(ts)
        gate, up = stack[:, t * w : (t + 1) * w], stack[:, intermediate + t * w :][:, :w]
        return torch.cat([gate, up], dim=1)

    def down_slice(ts: Sequence[torch.Tensor]) -> torch.Tensor:
        return derive_down(ts)[..., t * w : (t + 1) * w]

    return (gate_up_slice, down_slice)


def _num_experts(layout: str, down: list[nn.Parameter]) -> int:
    return int(down[0].shape[0]) if layout == "fused" else len(down)


def _build_block(
    block: nn.Module,
    name: str,
    preset: MoePreset,
    config: ExpertParallelConfig,
    dims: ParallelDims,
    partitioned: PartitionedParams | None,
) -> tuple[ExpertParallelBlock, ReplacedBlock, list[tuple[str, ParamSwap]]]:
    experts_module = getattr(block, preset.experts_attr)
    whole: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
    if partitioned is not None:  # this block's experts only, released on leaving
        whole = partitioned.gathered(list(experts_module.parameters()))
    with whole, torch.no_grad():
        layout, gate_up, down, act_fn = _experts_layout(experts_module, name, config)
        num_experts, ep = _num_experts(layout, down), dims.topology.ep
        config.check_num_experts(num_experts, layer=name)
        rank = dims.coordinate["ep"]
        lo, hi = rank * num_experts // ep, (rank + 1) * num_experts // ep
        derive_gate_up, derive_down = _local_weights(layout, gate_up, down, lo, hi)
        tp_group = None
        if config.expert_tensor_parallel_size > 1:
            intermediate = int(derive_down([p.detach() for p in down]).shape[-1])
            derive_gate_up, derive_down = _tp_slices(
                derive_gate_up, derive_down, intermediate, dims, name
            )
            tp_group = dims.tp
        new_gate_up = aligned_expert_weight(
            derive_gate_up([p.detach() for p in gate_up]), requires_grad=gate_up[0].requires_grad
        )
        new_down = aligned_expert_weight(
            derive_down([p.detach() for p in down]), requires_grad=down[0].requires_grad
        )
    if partitioned is not None:  # before the next block's experts are made whole
        partitioned.partition([new_gate_up, new_down], expert=True)
    grad_scale = dims.topology.dp / dims.topology.dense_dp_size  # see _grouped_experts
    experts = GroupedExperts(
        new_gate_up, new_down, act_fn, grad_scale=grad_scale, use_grouped_mm=config.use_grouped_mm
    )
    bias_path = _correction_bias(block, name)
    router = getattr(block, preset.router_attr)
    new_block = ExpertParallelBlock(
        router=router,
        router_name=preset.router_attr,
        experts=experts,
        experts_name=preset.experts_attr,
        num_experts=num_experts,
        settings=router_settings(router, preset, config),
        transport=AllToAllTransport(dims.ep),
        correction_bias_path=bias_path,
        shared=_child(block, preset.shared_attr),
        shared_gate=_child(block, preset.shared_gate_attr),
        combine_impl=_combine_impl(config, new_down.device),
        score_apply="pre" if config.score_apply == "pre" else "post",
        tp_group=tp_group,
    )
    if bias_path is not None and "." not in bias_path:
        _move_tensor(block, new_block, bias_path)
    prefix = f"{name}.{preset.experts_attr}"
    swaps = [
        (
            f"{prefix}.gate_up_proj",
            ParamSwap(f"{prefix}.gate_up_proj", new_gate_up, tuple(gate_up), derive_gate_up),
        ),
        (
            f"{prefix}.down_proj",
            ParamSwap(f"{prefix}.down_proj", new_down, tuple(down), derive_down),
        ),
    ]
    bias_fqn = f"{name}.{bias_path}" if bias_path else None
    info = ReplacedBlock(name, preset.name, num_experts, (lo, hi), layout, bias_fqn)
    return new_block, info, swaps


def _combine_impl(config: ExpertParallelConfig, device: torch.device) -> CombineImpl:
    """The combine to use: ``auto`` is the fused kernel on CUDA, the reference elsewhere.

    With ``score_apply: "pre"`` the combine sums unit weights (the section refuses an explicit
    ``fused_weighted_sum`` with ``pre``; ``auto`` may still pick the kernel for that sum).
    """
    if config.combine_impl in ("weighted_sum", "fused_weighted_sum"):
        return config.combine_impl
    if config.combine_impl == "legacy_bmm":
        return "weighted_sum"  # DeepSpeed computes the same weighted sum as a batched matmul
    return "fused_weighted_sum" if device.type == "cuda" else "weighted_sum"


def _child(block: nn.Module, attr: str | None) -> tuple[str, nn.Module] | None:
    module = getattr(block, attr, None) if attr else None
    return (attr, module) if isinstance(module, nn.Module) and attr else None


def _move_tensor(old: nn.Module, new: nn.Module, name: str) -> None:
    """Re-registers ``old.<name>`` on ``new``: same object, kind and persistence."""
    value = getattr(old, name)
    if isinstance(value, nn.Parameter):
        new.register_parameter(name, value)
    else:
        persistent = name not in old._non_persistent_buffers_set
        new.register_buffer(name, value, persistent=persistent)


def parallelize_experts(
    model: nn.Module,
    mesh_or_parallel_dims: DeviceMesh | ParallelDims,
    config: ExpertParallelConfig | None = None,
    *,
    optimizer: torch.optim.Optimizer | None = None,
    partitioned: PartitionedParams | None = None,
) -> ReplacementReport:
    """Replace every recognised MoE block of ``model`` with an expert-parallel one (in place).

    Every rank of the mesh calls it the same way (it may create the mesh's derived groups).

    Args:
        model: A Hugging Face MoE model (Mixtral, Qwen2/3/3.5-MoE, DeepSeek-V2/V3) or any model
            whose blocks a preset recognises.
        mesh_or_parallel_dims: The mesh from `deepshard.comm.build_mesh`, or its
            `ParallelDims`; the experts are spread over its ``ep`` axis.
        config: The ``expert_parallel`` section; by default enabled with the mesh's ``ep``.
        optimizer: An optimizer built on the unreplaced model, remapped in place
            (`remap_optimizer`).
        partitioned: For a model partitioned already (built under ``deepshard.zero.Init``):
            how to make one block's experts whole and partition the new stacks
            (``deepshard.zero.Repartition``); see the module docstring.

    Returns:
        The `ReplacementReport`: replaced blocks, placements, expert shard maps, swaps.

    Raises:
        ConfigError: No MoE block was found, ``autoep_size`` disagrees with the mesh or does not
            divide a block's experts, a block has two correction biases, or its experts have
            an unknown layout.
    """
    dims = _dims_of(mesh_or_parallel_dims)
    section = _section(config, dims.topology)
    pattern = re.compile(section.moe_layer_pattern) if section.moe_layer_pattern else None
    targets = [
        (name, module, preset)
        for name, module in model.named_modules()
        if (pattern is None or pattern.search(name))
        and (preset := find_preset(module, section)) is not None
    ]
    if not targets:
        raise ConfigError(
            f"expert_parallel: no MoE block found in {type(model).__name__}; presets: "
            f"{', '.join(PRESETS)} (set expert_parallel.preset_model and moe_layer_pattern for "
            "other models)"
        )
    blocks, swaps = [], []
    for name, module, preset in targets:
        if not name:
            raise ConfigError(
                "parallelize_experts: the model is itself a MoE block; pass the model that "
                "contains it (the block is replaced in its parent)"
            )
        new_block, info, block_swaps = _build_block(
            module, name, preset, section, dims, partitioned
        )
        parent_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, attr, new_block)
        blocks.append(info)
        swaps += [s for _, s in block_swaps]
    expert_tp = section.expert_tensor_parallel_size > 1
    registry, maps = expert_placements(model, dims, swaps, partitioned, expert_tp)
    report = ReplacementReport(tuple(blocks), registry, maps, tuple(swaps))
    if dims.topology.ep > 1:  # every forward is now all-to-alls: generate in lockstep
        mark_collective_forward(model)
    if optimizer is not None:
        remap_optimizer(optimizer, report)
    return report
