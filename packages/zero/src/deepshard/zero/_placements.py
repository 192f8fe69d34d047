"""What ZeRO reads from parameter placements: global shapes, the reduction group, coordinates.

ZeRO stages 0-2 reduce every parameter they wrap over one process group. The caller says what
each parameter is through a `deepshard.interface.PlacementRegistry` (the engine builds the
default one: every parameter whole on every rank, reduced over ``dp × ep × sp``): its logical
global shape (a tensor-parallel slice is a box of it) and the axes its gradient is reduced over.
Here those are checked against the group ZeRO was given — the group must be exactly the ranks
that differ from this one on the reduction axes, in ascending order (row-major over those axes,
as `deepshard.comm.ParallelDims` builds it) — and each group member's coordinate on every mesh
axis is worked out, so the shard maps can carry one coordinate per axis.

Without a registry, ZeRO describes its group as a mesh of one ``dp`` axis of the group's size,
every parameter replicated over it: enough for shard maps within the group, and the behaviour of
a `ZeroOptimizer` built by hand on ``mesh["dp"]``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from deepshard.interface import ParamPlacement, PlacementRegistry, Topology
from deepshard.interface.errors import TopologyError

__all__ = ["GroupPlacements", "param_names", "registration_positions", "resolve_placements"]


def param_names(
    params: Sequence[Sequence[torch.Tensor]], named: Sequence[tuple[str, torch.Tensor]]
) -> tuple[tuple[str, ...], ...]:
    """Each trainable parameter's name, per group; ``param_groups.<g>.params.<i>`` if unnamed."""
    names = {id(param): name for name, param in named}
    return tuple(
        tuple(names.get(id(p), f"param_groups.{g}.params.{i}") for i, p in enumerate(group))
        for g, group in enumerate(params)
    )


def registration_positions(
    params: Sequence[Sequence[torch.Tensor]], named: Sequence[tuple[str, torch.Tensor]]
) -> tuple[tuple[int, ...], ...] | None:
    """Each trainable parameter's index in ``named``, per group; None unless all are named."""
    index = {id(param): i for i, (_, param) in enumerate(named)}
    if not all(id(p) in index for group in params for p in group):
        return None
    return tuple(tuple(index[id(p)] for p in group) for group in params)


@dataclass(frozen=True)
class GroupPlacements:
    """The placements of ZeRO's parameters and where its group's members sit on the mesh.

    Attributes:
        topology: The mesh's axis sizes.
        axes: The reduction axes every parameter shares (ZeRO partitions over them).
        placements: Each trainable parameter's placement, per param group.
        member_coords: Each group member's coordinate on every mesh axis, by group rank.
    """

    topology: Topology
    axes: tuple[str, ...]
    placements: tuple[tuple[ParamPlacement, ...], ...]
    member_coords: tuple[tuple[int, ...], ...]


def _one_reduction_group(
    names: Sequence[Sequence[str]],
    placements: Sequence[Sequence[ParamPlacement]],
    default: tuple[str, ...],
) -> tuple[str, ...]:
    seen: dict[tuple[str, ...], str] = {}
    for group_names, group_placements in zip(names, placements, strict=True):
        for name, placement in zip(group_names, group_placements, strict=True):
            seen.setdefault(placement.reduce_over, name)
    if len(seen) > 1:
        found = ", ".join(f"{name!r} over {axes}" for axes, name in seen.items())
        raise TopologyError(
            f"ZeRO stages 0-2 reduce every parameter they wrap over one group, but {found}; "
            "wrap each kind in its own ZeroOptimizer with its group (e.g. expert parameters "
            "with group=ParallelDims.expert_dp)"
        )
    return next(iter(seen), default)  # no trainable parameter: nothing to disagree with


def _members(group: dist.ProcessGroup, topology: Topology, axes: tuple[str, ...]) -> list[int]:
    """Global ranks of ``group`` by group rank, checked to be the reduction group over ``axes``."""
    members = dist.get_process_group_ranks(group)
    if topology.world_size != dist.get_world_size():
        raise TopologyError(
            f"the placement registry's topology covers {topology.world_size} ranks but the "
            f"world has {dist.get_world_size()}; build the registry from the training topology"
        )
    mine = topology.coords(dist.get_global_rank(group, group.rank()))
    expected = [
        rank
        for rank in range(topology.world_size)
        if all(c == mine[a] for a, c in topology.coords(rank).items() if a not in axes)
    ]
    if members != expected:
        raise TopologyError(
            f"ZeRO was given a group with ranks {members}, but its parameters are reduced over "
            f"{axes}, whose group for this rank is {expected}; pass "
            f"ParallelDims.group_over({axes}) (dense parameters: ParallelDims.dense_dp)"
        )
    return members


def _check_local_shapes(
    params: Sequence[Sequence[torch.Tensor]],
    names: Sequence[Sequence[str]],
    placements: Sequence[Sequence[ParamPlacement]],
    topology: Topology,
) -> None:
    for group_params, group_names, group_placements in zip(params, names, placements, strict=True):
        for param, name, placement in zip(group_params, group_names, group_placements, strict=True):
            local = placement.local_shape(topology)
            if tuple(param.shape) != local:
                raise TopologyError(
                    f"parameter {name!r} has shape {tuple(param.shape)} but its placement "
                    f"(global shape {placement.global_shape}) gives this rank {local}; register "
                    "the placement of the parallelised model"
                )


def resolve_placements(
    group: dist.ProcessGroup,
    params: Sequence[Sequence[torch.Tensor]],
    names: Sequence[Sequence[str]],
    registry: PlacementRegistry | None,
) -> GroupPlacements:
    """Each parameter's placement and each group member's mesh coordinate, checked.

    Args:
        group: ZeRO's data-parallel group.
        params: Trainable parameters per param group.
        names: Their names (`param_names`).
        registry: The placements; None describes the group as a one-axis ``dp`` mesh.

    Raises:
        TopologyError: A parameter has no placement, or one whose local shape differs from the
            parameter's; the parameters do not share one reduction group; the group is not
            that reduction group.
    """
    members: list[int] | None = None
    default_axes = Topology.dense_dp_axes
    if registry is None:
        default_axes = ("dp",)
        topology = Topology(dp=group.size())
        named = [
            (n, p)
            for gn, gp in zip(names, params, strict=True)
            for n, p in zip(gn, gp, strict=True)
        ]
        registry = PlacementRegistry.replicated(named, topology, reduce_over=("dp",))
        members = list(range(group.size()))
    topology = registry.topology
    placements = tuple(tuple(registry.require(n) for n in group_names) for group_names in names)
    axes = _one_reduction_group(names, placements, default_axes)
    if members is None:
        members = _members(group, topology, axes)
    _check_local_shapes(params, names, placements, topology)
    coords = tuple(tuple(topology.coords(rank).values()) for rank in members)
    return GroupPlacements(topology, axes, placements, coords)
