"""Several reduction groups in one sharded model: expert and dense parameters (stage 3).

A MoE model's expert weights are data-parallel over ``dp`` only (each ``ep`` rank holds other
experts), its dense weights over ``dp × ep × sp``; the placements (`deepshard.interface.
PlacementRegistry`) say which parameter is which through ``reduce_over``. `reduction_groups`
finds the process group of every group the placements name besides the dense one, and
`deepshard.zero._units.plan_units` gives each (unit × group) its own flat layout over that
group, gathered, released and reduce-scattered there (each group averages its own gradients).

**The gradient norm.** The global norm is that of the vector of every distinct element of the
model. A dense element sits in exactly one rank's partition within the dense group; an expert
element in exactly one rank's partition within its expert group, and the ``ep`` ranks of the
dense group hold *other* experts, so within the dense group each expert element also sits in
exactly one rank's partition. Hence each rank adds its dense and expert partitions' ``Σ|g|^p``
into one number and a single all-reduce over the dense group counts every element once — the
same one collective as with one group. This needs every group's axes inside the dense axes
and the dense axes outside a group's axes to hold different parameters (``ep`` for experts);
`reduction_groups` refuses groups reaching outside the dense axes. Clipping scales every
partition by the one factor from that norm.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from deepshard.comm import ParallelDims, resolve_group
from deepshard.interface import PlacementRegistry, Shard, Topology
from deepshard.interface.config import ZeroConfig
from deepshard.interface.errors import ConfigError, TopologyError

__all__ = ["axes_of", "mixed_group_problems", "reduction_groups"]

ProcessGroup = torch.distributed.ProcessGroup


def reduction_groups(
    module: torch.nn.Module,
    pg: ProcessGroup,
    parallel_dims: ParallelDims | None,
    placements: PlacementRegistry | None,
) -> dict[tuple[str, ...], ProcessGroup]:
    """The process group of every reduction group the placements name other than ``pg``.

    Args:
        module: The model.
        pg: The dense data-parallel group `deepshard.zero.shard` partitions over.
        parallel_dims: The mesh owning the other groups (``None``: ``shard(group=...)``).
        placements: The parameters' placements.

    Raises:
        ConfigError: Several groups are named but ``shard`` was given ``group=``.
        TopologyError: A group reaches outside the dense axes, or `ParallelDims` lacks it.
    """
    if placements is None:
        return {}
    names = [name for name, p in module.named_parameters() if p.requires_grad]
    found = {placements[n].reduce_over for n in names if n in placements}
    if parallel_dims is None:
        if len(found) > 1:
            raise ConfigError(
                f"the placements name several reduction groups {sorted(found)}; pass "
                "parallel_dims= to shard() instead of group=, so each group can be found"
            )
        return {}
    outside = sorted(a for axes in found for a in axes if a not in Topology.dense_dp_axes)
    if len(found) > 1 and outside:
        raise TopologyError(
            f"reduce_over names axes {outside} outside the dense data-parallel axes "
            f"{Topology.dense_dp_axes}; with several reduction groups each must lie inside "
            "them (the gradient norm is combined over the dense group)"
        )
    if len(found) > 1:
        _check_norm_counts_once(module, placements, parallel_dims.topology)
    groups = {axes: resolve_group(parallel_dims.group_over(axes)) for axes in found}
    return {axes: g for axes, g in groups.items() if g is not pg}


def _check_norm_counts_once(
    module: torch.nn.Module, placements: PlacementRegistry, topology: Topology
) -> None:
    """Refuse a parameter replicated along a dense axis its group leaves out.

    The one-all-reduce norm counts each element once only when the ranks along every dense axis
    outside a parameter's reduction group hold *different* pieces of it (experts split over
    ``ep``); a parameter merely replicated there (an expert copied over ``sp`` > 1) would be
    counted once per copy.
    """
    for name, param in module.named_parameters():
        if not param.requires_grad or name not in placements:
            continue
        placement = placements[name]
        by_axis = dict(zip(placement.axes, placement.placements, strict=True))
        for axis in Topology.dense_dp_axes:
            size = getattr(topology, axis)
            if axis in placement.reduce_over or size == 1 or isinstance(by_axis[axis], Shard):
                continue
            raise TopologyError(
                f"{name!r} reduces over {placement.reduce_over} but is replicated along "
                f"{axis!r} (size {size}), so the combined gradient norm would count it {size} "
                f"times; add {axis!r} to its reduce_over or shard it along {axis!r}"
            )


def axes_of(
    module: torch.nn.Module,
    placements: PlacementRegistry | None,
    groups: Mapping[tuple[str, ...], ProcessGroup],
) -> dict[str, tuple[str, ...]]:
    """Each parameter reduced over one of ``groups`` (by name) → that group's axes."""
    if placements is None or not groups:
        return {}
    return {
        name: placements[name].reduce_over
        for name, _ in module.named_parameters()
        if name in placements and placements[name].reduce_over in groups
    }


def mixed_group_problems(config: ZeroConfig, *, transformed: bool) -> list[tuple[str, str]]:
    """``(key, message)`` for what a `ZeroOptimizer` over a model with several reduction
    groups cannot do yet."""
    problems = []
    if config.offload_optimizer is not None and config.offload_optimizer.device != "none":
        problems.append(
            (
                "zero_optimization.offload_optimizer",
                "not built for a model with several reduction groups (expert and dense "
                "parameters) yet; leave it out",
            )
        )
    if transformed:
        problems.append(
            (
                "full_grad_transform",
                "Muon is not built for a model with several reduction groups (expert and "
                "dense parameters) yet; use an element-wise optimizer",
            )
        )
    return problems
