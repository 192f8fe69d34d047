"""Where a ZeRO optimizer keeps what `deepshard.zero._state_shards` describes, stage by stage.

Everything a checkpoint needs of ZeRO is laid out like one of this rank's fp32 master
partitions (a param group's at stages 0-2, a unit's trainable prefix at stage 3): the master
itself and the inner optimizer's per-element state, which is kept per *master view* (ranges of
the partition of at most 1 MiB, or one per Muon matrix piece), or, with optimizer offload and
the CPU Adam kernel, as whole host moments. A `Region` is one such partition: its master and
the state *segments* that cover ranges of it. Parameters are mapped onto regions by their
`ParamShard` (``local_offset`` into the region's master).

With NVMe offload the masters and moments are read from their files here (fresh host tensors),
and `finish_load` writes them back; on the host (``cpu``) and on the device they are the live
tensors themselves.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from deepshard.interface import ShardPiece
from deepshard.zero._shards import ParamShard

if TYPE_CHECKING:
    from deepshard.zero._full_grads import BufferAccess
    from deepshard.zero._offload import HostOffload
    from deepshard.zero._param_offload import PartitionHome
    from deepshard.zero._stage3_optimizer import Stage3Optimizer
    from deepshard.zero.optimizer import ZeroOptimizer

__all__ = ["ParamPlace", "Region", "Regions", "flat_regions", "stage3_regions"]

Segment = tuple[Mapping[str, Any], int, int]
"""``(state, lo, hi)``: the state tensors of elements ``[lo, hi)`` of a region's master."""


@dataclass(frozen=True)
class Region:
    """One fp32 master partition of this rank and the state laid out like it.

    Attributes:
        master: The 1-D fp32 master (live, or read from files with NVMe offload).
        segments: The per-element state over ranges of ``master``, in range order.
    """

    master: torch.Tensor
    segments: tuple[Segment, ...]


@dataclass(frozen=True)
class ParamPlace:
    """One parameter in the regions.

    Attributes:
        shard: Its name and shard map (``local_offset`` into its region's master).
        region: Index of its region (param group at stages 0-2, unit at stage 3).
        model: This rank's elements of the model's own copy (its dtype), one tensor per piece.
        model_dtype: The model copy's dtype.
        trainable: Whether it has a master and optimizer state.
        write_model: Stores loaded values of a parameter without a master (stage-3 frozen ones:
            ``(values, piece index)``); ``None`` where the masters are the source of truth.
        group_rank: This rank's index in the group its unit is partitioned over when that is
            not the optimizer's (a stage-3 expert unit); ``None``: the optimizer's group.
    """

    shard: ParamShard
    region: int
    model: tuple[torch.Tensor, ...]
    model_dtype: torch.dtype
    trainable: bool = True
    write_model: Callable[[torch.Tensor, int], None] | None = None
    group_rank: int | None = None


@dataclass
class Regions:
    """Every region and parameter of one optimizer on this rank, and its scalar state.

    Attributes:
        regions: By region index.
        params: Every parameter, trainable first in layout order.
        kernel_steps: With the CPU Adam kernel (offload), its step count per offload group.
        offload: The optimizer's offload, if any.
        whole: With offload, what ``offload.state.whole()`` returned (masters, then moments).
        full: The full-gradient path (Muon's momentum buffers), if any.
    """

    regions: list[Region]
    params: list[ParamPlace]
    kernel_steps: list[int] | None = None
    offload: HostOffload | None = None
    whole: list[list[torch.Tensor]] = field(default_factory=list)
    full: BufferAccess | None = None


def _inner_segments(
    inner: torch.optim.Optimizer, views: list[tuple[torch.Tensor, int, int]], numel: int
) -> tuple[Segment, ...]:
    segments = [(inner.state.get(view, {}), lo, hi) for view, lo, hi in views if hi > lo]
    for key in {k for state, lo, hi in segments for k, v in state.items() if _flat(v, hi - lo)}:
        _rehome(segments, key, numel)
    return tuple(segments)


def _flat(value: object, numel: int) -> bool:
    """Whether ``value`` is per-element state of a view of ``numel`` elements."""
    return isinstance(value, torch.Tensor) and value.dim() > 0 and value.numel() == numel


def _rehome(segments: list[tuple[dict[str, Any], int, int]], key: str, numel: int) -> None:
    """Point state ``key`` of every view at one tensor laid out like the master.

    torch's optimizers keep a tensor per view, so a parameter straddling two views would have
    its moments in two storages; views of one flat tensor per key (updated in place by the
    optimizer, as before) make every parameter's state one live slice. Done once: a later call
    finds the views already flat and copies nothing.
    """
    held = [(state, lo, hi) for state, lo, hi in segments if _flat(state.get(key), hi - lo)]
    values = [state[key] for state, _, _ in held]
    if len({(v.dtype, v.device) for v in values}) != 1:
        return  # mixed dtypes or devices: leave them (the shards copy instead)
    base = {v.storage_offset() - lo for v, (_, lo, _) in zip(values, held, strict=True)}
    storages = {v.untyped_storage().data_ptr() for v in values}
    if len(base) == 1 and len(storages) == 1 and all(v.is_contiguous() for v in values):
        return
    flat = torch.zeros(numel, dtype=values[0].dtype, device=values[0].device)
    for (state, lo, hi), value in zip(held, values, strict=True):
        flat[lo:hi].copy_(value.reshape(-1))
        state[key] = flat[lo:hi].view(value.shape)


def _offload_regions(
    inner: torch.optim.Optimizer, offload: HostOffload
) -> tuple[list[Region], list[list[torch.Tensor]], list[int] | None]:
    """Regions over the host masters (read from the files with NVMe)."""
    whole = offload.state.whole()
    masters, moments = whole[0], whole[1:]
    regions = []
    for g, master in enumerate(masters):
        if moments:  # the CPU Adam kernel: whole-partition moments, no inner state
            state = {"exp_avg": moments[0][g], "exp_avg_sq": moments[1][g]}
            segments: tuple[Segment, ...] = ((state, 0, master.numel()),) if master.numel() else ()
        else:
            segments = _inner_segments(inner, offload.views[g], master.numel())
        regions.append(Region(master, segments))
    steps = offload.steps if moments else None
    return regions, whole, steps


def flat_regions(opt: ZeroOptimizer) -> Regions:
    """Stages 0-2: one region per unit (a param group's layout, per reduction group with
    several); the model copy is the flat buffer (whole). With several reduction groups an
    expert unit's parameters carry their group's rank, as at stage 3."""
    offload = opt._offload
    if offload is None:
        regions = [
            Region(master, _inner_segments(opt.inner, views, master.numel()))
            for master, views in zip(opt._masters, opt._full.views, strict=True)
        ]
        whole: list[list[torch.Tensor]] = []
        steps = None
    else:
        regions, whole, steps = _offload_regions(opt.inner, offload)
    rank = opt.partition_group.rank()
    resident = opt._resident
    shards = iter(opt.shard_maps())
    params = []
    for g, flat in enumerate(opt._flat):
        # an expert unit's maps are over its own group: its pieces are by that group's rank
        group = resident.units[g].group
        own = group.rank() if resident.mixed_groups and group is not resident.group else None
        for slot in flat.layout.slots:
            shard = next(shards)
            model = tuple(
                flat.buffer[slot.offset + p.flat_start : slot.offset + p.stop]
                for p in shard.shard_map.pieces_of(rank if own is None else own)
            )
            params.append(ParamPlace(shard, g, model, flat.buffer.dtype, group_rank=own))
    return Regions(regions, params, steps, offload, whole, opt._full)


def stage3_regions(opt: Stage3Optimizer) -> Regions:
    """Stage 3: one region per unit (its trainable prefix); frozen parameters have no master.
    With several reduction groups an expert unit's parameters carry their group's rank."""
    offload = opt._offload
    if offload is None:
        regions = [
            Region(master, _inner_segments(opt.inner, [(v, lo, hi) for u, v, lo, hi in opt._views
                                                       if u == unit], master.numel()))
            for unit, master in enumerate(opt._masters)
        ]  # fmt: skip
        whole: list[list[torch.Tensor]] = []
        steps = None
    else:
        regions, whole, steps = _offload_regions(opt.inner, offload)
    rank = opt.partition_group.rank()
    sharded = opt.sharded
    params = []
    for plan in sharded.plans:
        unit = sharded.units[plan.index]
        home, partition = unit.home, unit.home.read()
        # an expert unit is partitioned over its own group: its pieces are by that group's rank
        own = unit.rank if unit.group is not sharded.group else None
        for param in plan.params:
            info = sharded.shard_info(param)
            pieces = info.shard.shard_map.pieces_of(rank if own is None else own)
            model = tuple(partition[p.local_offset : p.local_offset + p.numel] for p in pieces)
            writer = None if param.requires_grad else _home_writer(home, pieces)
            trainable = param.requires_grad
            params.append(
                ParamPlace(info.shard, plan.index, model, plan.dtype, trainable, writer, own)
            )
    params.sort(key=lambda p: not p.trainable)
    return Regions(regions, params, steps, offload, whole, opt._transforms)


def _home_writer(
    home: PartitionHome, pieces: tuple[ShardPiece, ...]
) -> Callable[[torch.Tensor, int], None]:
    """Writes a frozen parameter's loaded piece into its unit's partition home."""

    def write(values: torch.Tensor, index: int) -> None:
        # a clone: a file home may write behind from the tensor it is given
        home.write(values.reshape(-1).clone(), pieces[index].local_offset)

    return write
