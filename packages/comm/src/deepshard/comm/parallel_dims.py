"""`ParallelDims`: the mesh and every group derived from it, built once at the edge.

A `deepshard.interface.Topology` is data; `ParallelDims.build` turns it into the five-axis
`DeviceMesh` (`build_mesh`) and, at the same time, every group the packages below need:

* ``dense_dp`` — ``dp × ep × sp``: dense parameters are replicated, and their gradients
  reduced, over these ranks (`Topology.dense_dp_axes`);
* ``expert_dp`` — ``dp``: the replicas of one expert (`Topology.expert_dp_axes`);
* ``batch`` — ``dp × ep``: the ranks that each read their own micro-batch (tp and sp peers
  share samples), with `batch_rank` and `batch_world_size`;
* ``tp``, ``sp``, ``ep`` — single mesh axes; ``world`` — every rank.

Each is a 1-D `DeviceMesh` rather than a bare ProcessGroup: the collectives and ZeRO accept a
1-D mesh (``.get_group()`` gives the group), and a mesh keeps its device type and a name
(``"dp_ep"``) that says which axes it spans, as DTensor-style APIs expect.

A group over several axes is a new process group. PyTorch's only way to flatten mesh axes is
the private ``DeviceMesh._flatten``, so the groups are made with public calls instead:
``new_subgroups_by_enumeration`` creates one group per combination of the other axes' coordinates
(every rank must create every group, in the same order, which is why they are all built here,
eagerly, and never on first use), and ``DeviceMesh.from_group`` wraps this rank's group. Members
are in ascending global rank, which is row-major order over the spanned axes (the mesh is
row-major with the axes in `Topology.AXES` order), so a rank's index in ``batch`` is
``dp_rank × ep + ep_rank``. Nothing is created when at most one of the spanned axes is larger
than 1 (that axis's own group serves) or when the group is the whole world at the default
timeout (the default group serves). New groups get the same timeout as `build_mesh` gives the
axis groups: the argument, else the default group's.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from deepshard.comm.mesh import build_mesh, group_timeouts
from deepshard.interface import Topology
from deepshard.interface.errors import CommError, TopologyError

__all__ = ["ParallelDims"]

BATCH_AXES: tuple[str, ...] = ("dp", "ep")
"""Axes whose ranks read different samples (`Topology.batch_world_size`)."""

_DERIVED = (
    Topology.dense_dp_axes,
    Topology.expert_dp_axes,
    BATCH_AXES,
    Topology.AXES,
    *((axis,) for axis in Topology.AXES),
)


def _spanned(topology: Topology, axes: Sequence[str]) -> tuple[str, ...]:
    """The axes of ``axes`` larger than 1: the ones that make the group's members differ."""
    return tuple(a for a in axes if getattr(topology, a) > 1)


def _member_lists(topology: Topology, axes: Sequence[str]) -> list[list[int]]:
    """Every group over ``axes``: ranks equal on all other axes, ascending, by first member.

    Args:
        topology: The axis sizes.
        axes: The axes the groups span.

    Returns:
        One ascending rank list per group; together they hold every rank once.
    """
    groups: dict[tuple[int, ...], list[int]] = {}
    for rank in range(topology.world_size):
        coords = topology.coords(rank)
        key = tuple(c for a, c in coords.items() if a not in axes)
        groups.setdefault(key, []).append(rank)
    return sorted(groups.values())


def _new_group_mesh(
    topology: Topology, axes: tuple[str, ...], device_type: str, timeout: timedelta | None
) -> DeviceMesh:
    # Every rank creates every group, in the same order (the caller builds all sets eagerly).
    mine, _ = dist.new_subgroups_by_enumeration(_member_lists(topology, axes), timeout=timeout)
    if not isinstance(mine, dist.ProcessGroup):  # every rank is in one of the groups
        raise CommError(f"this rank is in none of the groups over {axes}; is the world intact?")
    return DeviceMesh.from_group(mine, device_type, mesh_dim_names=("_".join(axes),))


def _derived_groups(
    mesh: DeviceMesh, topology: Topology, timeout: timedelta | None
) -> dict[tuple[str, ...], DeviceMesh]:
    timeouts = group_timeouts(mesh.device_type, timeout)
    wanted, default = timeouts if timeouts is not None else (None, None)
    groups: dict[tuple[str, ...], DeviceMesh] = {}
    for axes in _DERIVED:
        spanned = _spanned(topology, axes)
        if spanned in groups:
            continue
        if len(spanned) <= 1:
            groups[spanned] = mesh[spanned[0] if spanned else "dp"]
        elif math.prod(getattr(topology, a) for a in spanned) == topology.world_size and (
            wanted == default
        ):
            world = dist.group.WORLD
            assert isinstance(world, dist.ProcessGroup)
            name = ("_".join(spanned),)
            groups[spanned] = DeviceMesh.from_group(world, mesh.device_type, mesh_dim_names=name)
        else:
            groups[spanned] = _new_group_mesh(topology, spanned, mesh.device_type, wanted)
    return groups


def _topology_of(mesh: DeviceMesh) -> Topology:
    names = tuple(mesh.mesh_dim_names or ())
    if names != Topology.AXES:
        raise TopologyError(
            f"the mesh has axes {names or '(unnamed)'}; DeepShard needs the five axes "
            f"{Topology.AXES} in that order: build it with deepshard.comm.build_mesh(topology) "
            "or ParallelDims.build(topology)"
        )
    topology = Topology(**dict(zip(names, mesh.shape, strict=True)))
    if mesh.mesh.flatten().tolist() != list(range(topology.world_size)):
        raise TopologyError(
            "the mesh does not hold the ranks in row-major order (rank r at the r-th position); "
            "build it with deepshard.comm.build_mesh(topology)"
        )
    return topology


@dataclass(frozen=True, eq=False)
class ParallelDims:
    """The training mesh and its derived groups; every group is built at construction.

    Build it with `build` (from a topology) or `from_mesh` (from a mesh the caller built); every
    rank must call either, the same way, because both create process groups.

    Example:
        >>> dims = ParallelDims.build(Topology.from_world(8, ep=2))  # doctest: +SKIP
        >>> dims.dense_dp.size(), dims.expert_dp.size(), dims.batch_world_size  # doctest: +SKIP
        (8, 4, 8)
    """

    topology: Topology
    """The axis sizes."""

    mesh: DeviceMesh
    """The five-axis mesh (``mesh["tp"]`` ...), axes in `Topology.AXES` order."""

    groups: Mapping[tuple[str, ...], DeviceMesh] = field(repr=False)
    """Every derived 1-D mesh, keyed by the axes larger than 1 it spans (see `group_over`)."""

    @classmethod
    def build(
        cls,
        topology: Topology,
        *,
        device_type: str | None = None,
        timeout: timedelta | None = None,
    ) -> ParallelDims:
        """Create the mesh for ``topology`` (`build_mesh`) and every derived group.

        Args:
            topology: The parallel layout; its world size must equal the default group's.
            device_type: As in `build_mesh`.
            timeout: Timeout of every group created; defaults to the default group's.

        Raises:
            CommError: No default process group, or groups that cannot take the timeout.
            TopologyError: The topology does not cover the world.
        """
        mesh = build_mesh(topology, device_type=device_type, timeout=timeout)
        return cls(topology, mesh, _derived_groups(mesh, topology, timeout))

    @classmethod
    def from_mesh(cls, mesh: DeviceMesh, *, timeout: timedelta | None = None) -> ParallelDims:
        """Derive the groups of a mesh built by `build_mesh` (or laid out the same way).

        Raises:
            TopologyError: The mesh lacks DeepShard's five axes or its row-major rank order.
            CommError: As `build`.
        """
        topology = _topology_of(mesh)
        return cls(topology, mesh, _derived_groups(mesh, topology, timeout))

    def group_over(self, axes: Sequence[str]) -> DeviceMesh:
        """The 1-D mesh of the ranks that differ from this one only on ``axes``.

        Args:
            axes: Mesh axes, e.g. ``("dp", "ep", "sp")``; size-1 axes change nothing.

        Raises:
            TopologyError: No group over those axes was built (only the sets named in the
                module docstring are, since groups cannot be created later by one rank alone).
        """
        for axis in axes:
            if axis not in Topology.AXES:
                raise TopologyError(f"unknown axis {axis!r}; the axes are {Topology.AXES}")
        spanned = _spanned(self.topology, [a for a in Topology.AXES if a in axes])
        if spanned not in self.groups:
            raise TopologyError(
                f"no group over {tuple(axes)} was built; ParallelDims builds dense_dp "
                f"{Topology.dense_dp_axes}, expert_dp {Topology.expert_dp_axes}, batch "
                f"{BATCH_AXES}, world and single axes (create others with "
                "torch.distributed.new_subgroups_by_enumeration on every rank)"
            )
        return self.groups[spanned]

    @property
    def rank(self) -> int:
        """This process's global rank."""
        return self.mesh.get_rank()

    @property
    def coordinate(self) -> dict[str, int]:
        """This rank's coordinate on every axis."""
        return self.topology.coords(self.rank)

    @property
    def world(self) -> DeviceMesh:
        """Every rank."""
        return self.group_over(Topology.AXES)

    @property
    def dense_dp(self) -> DeviceMesh:
        """``dp × ep × sp``: the reduction group of dense parameters (ZeRO's group)."""
        return self.group_over(Topology.dense_dp_axes)

    @property
    def expert_dp(self) -> DeviceMesh:
        """``dp``: the reduction group of expert parameters."""
        return self.group_over(Topology.expert_dp_axes)

    @property
    def batch(self) -> DeviceMesh:
        """``dp × ep``: the ranks that read different samples."""
        return self.group_over(BATCH_AXES)

    @property
    def batch_rank(self) -> int:
        """This rank's index among the ranks reading different samples."""
        return self.batch.get_local_rank()

    @property
    def batch_world_size(self) -> int:
        """How many ranks read different samples (dp × ep)."""
        return self.topology.batch_world_size

    @property
    def tp(self) -> DeviceMesh:
        """The tensor-parallel axis."""
        return self.mesh["tp"]

    @property
    def sp(self) -> DeviceMesh:
        """The sequence-parallel axis."""
        return self.mesh["sp"]

    @property
    def ep(self) -> DeviceMesh:
        """The expert-parallel axis."""
        return self.mesh["ep"]
