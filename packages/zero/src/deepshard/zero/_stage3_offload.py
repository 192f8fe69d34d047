"""Optimizer offload at ZeRO stage 3: the stage 1-2 host pipeline over unit partitions.

At stage 3 every unit has its own partition, and the inner optimizer's param groups cut across
units. The stage 1-2 machinery (`deepshard.zero._offload.HostOffload`: per sub-group gradient
copy to the host, CPU Adam kernel, write-back in the compute dtype; `HostState` / `NvmeState`
for the fp32 masters and moments; the `Swapper`) runs unchanged with two mappings:

* **Pipeline groups are units.** Host masters, moments, gradient and output buffers (and NVMe
  files) are one per unit partition, each over its *trainable prefix* only (frozen parameters
  sit at the end of the unit's layout and get no master), and a `SubGroup`'s ``group`` is the
  unit.
* **Sub-groups never cross a param group.** They are the stage-3 optimizer's merged master
  ranges (consecutive pieces of one unit that belong to one param group, merged across the
  alignment padding between them), cut at ``sub_group_size``; ``SubGroup.hyper`` names the
  param group whose hyper-parameters step them. Elements in no range (frozen parameters, the
  padding at a partition's end) are never stepped, as without offload. Sub-groups are ordered by
  unit, so a unit's writes are consecutive.

With ``ratio`` below 1 (partial offload, `deepshard.zero._partial_offload`) the first
``int((1 - ratio) · n)`` of those sub-groups are stepped on the device and the pipeline runs
the rest.

The stepped values are written back through the unit's home (`deepshard.zero._param_offload`):
into the device partition, the host partition (``offload_param: cpu``) or behind into its file
(``offload_param: nvme``).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

from deepshard.interface.config import AioConfig, ZeroConfig
from deepshard.zero._flat_params import master_views
from deepshard.zero._master_dtype import host_moment_dtype
from deepshard.zero._offload import HostOffload, Views, _accelerator, grad_staging
from deepshard.zero._offload_plan import SubGroup, adam_rule, offload_device
from deepshard.zero._offload_state import HostState, NvmeState, host_allocator
from deepshard.zero._optimizer_check import master_view_numel
from deepshard.zero._param_offload import HostHome
from deepshard.zero._partial_offload import DeviceShare, split_sub_groups
from deepshard.zero._sharded import ShardedModule
from deepshard.zero._stage3_masters import follow_partition

__all__ = ["build_stage3_offload", "follow_partitions", "stage3_sub_groups"]

Ranges = Sequence[Sequence[tuple[int, int, int]]]
"""Per param group, the ``(unit, lo, hi)`` master ranges it steps."""


def stage3_sub_groups(ranges: Ranges) -> tuple[SubGroup, ...]:
    """Sub-groups of stage-3 master ranges, ordered by unit then offset.

    Args:
        ranges: Per param group, ``(unit, lo, hi)`` ranges of unit partitions, already cut to at
            most ``sub_group_size`` elements.

    Returns:
        One `SubGroup` per range (``group`` = unit, ``hyper`` = param group).
    """
    flat = sorted((unit, lo, hi, g) for g, mine in enumerate(ranges) for unit, lo, hi in mine)
    return tuple(
        SubGroup(unit, k, lo, hi, hyper=g) for k, (unit, lo, hi, g) in enumerate(flat) if hi > lo
    )


def _inner_views(
    optimizer: torch.optim.Optimizer, masters: Sequence[torch.Tensor], subs: Sequence[SubGroup]
) -> list[Views]:
    """Host master views for an optimizer stepped as itself; its groups are re-pointed."""
    view_numel = master_view_numel(optimizer, transformed=False)
    views: list[Views] = [[] for _ in masters]
    groups: list[list[torch.Tensor]] = [[] for _ in optimizer.param_groups]
    for sub in subs:
        piece = masters[sub.group][sub.start : sub.stop]
        for view, lo, hi in master_views(piece, view_numel):
            views[sub.group].append((view, sub.start + lo, sub.start + hi))
            groups[sub.param_group].append(view)
    for group, params in zip(optimizer.param_groups, groups, strict=True):
        group["params"] = params
    return views


def build_stage3_offload(
    config: ZeroConfig,
    optimizer: torch.optim.Optimizer,
    sharded: ShardedModule,
    ranges: Ranges,
    trainable: Sequence[int],
    aio: AioConfig | None,
    master_dtype: torch.dtype = torch.float32,
    state_dtype: torch.dtype | None = None,
) -> HostOffload | None:
    """The host side of stage-3 optimizer offload, or ``None`` when the config has none.

    Builds the fp32 masters on the host (or in the files) from the unit partitions and
    re-points the inner optimizer's param groups at host master views (or empties them when
    the CPU Adam kernel steps).

    Args:
        config: The ``zero_optimization`` section, already checked by ``offload_problems``.
        optimizer: The inner optimizer.
        sharded: The model side; its units' homes receive the updated parameters.
        ranges: Per param group, the ``(unit, lo, hi)`` ranges it steps.
        trainable: Per unit, the elements its master covers (the partition's trainable prefix).
        aio: The ``aio`` section (NVMe).
        master_dtype: The host masters' dtype (fp32, or 16-bit masters).
        state_dtype: The moments' dtype (``bf16_optimizer_states``); None: `host_moment_dtype`.
    """
    section, kind = config.offload_optimizer, offload_device(config)
    if section is None or kind == "none":
        return None
    units = sharded.units
    device = units[0].buffer.device
    rule = adam_rule(optimizer)
    allocate = host_allocator(_accelerator(device), section.pin_memory)
    share, subs = split_sub_groups(stage3_sub_groups(ranges), section.ratio)
    numels = list(trainable)
    values = [u.home.read()[:n] for u, n in zip(units, numels, strict=True)]
    moment_dtype = host_moment_dtype(optimizer, master_dtype, state_dtype)
    state: HostState | NvmeState
    masters: list[torch.Tensor] | None = None
    if kind == "nvme":
        prefix, aio = f"zero3-pid{os.getpid()}-", aio if aio is not None else AioConfig()
        own = [v.to(master_dtype) for v in values]
        state = NvmeState(own, subs, section, aio, moment_dtype, allocate, prefix=prefix)
    else:
        masters = [
            v if _own_master(u, master_dtype) else allocate(n, master_dtype).copy_(v)
            for u, n, v in zip(units, numels, values, strict=True)
        ]
        state = HostState(masters, moment_dtype if rule else None, allocate)
    host_out = [
        masters[i] if masters is not None and u.plan.dtype == master_dtype
        else allocate(n, u.plan.dtype)
        for i, (u, n) in enumerate(zip(units, numels, strict=True))
    ]  # fmt: skip
    if rule is None:
        assert masters is not None, "offload_problems refuses nvme without Adam"
        views = _inner_views(optimizer, masters, subs)
    else:
        views = [[] for _ in units]
        for group in optimizer.param_groups:
            group["params"] = []

    def write_back(sub: SubGroup, out: torch.Tensor) -> None:
        units[sub.group].home.write(out, sub.start)

    device_share = None
    if share:  # offload_problems allows ratio < 1 with the CPU Adam kernel and host buffers
        on_device = [v.to(device) for v in values]
        device_share = DeviceShare(share, on_device, moment_dtype, device, master_dtype)
    staging = grad_staging(subs, allocate, torch.float32 if rule else master_dtype)
    return HostOffload(subs, state, rule, views, staging, host_out, [],
                       write_back=write_back, device=device, device_share=device_share)  # fmt: skip


def _own_master(unit: object, master_dtype: torch.dtype) -> bool:
    """Whether a unit's host partition can be its own master (a `HostHome` in the masters'
    dtype).

    With ``offload_param: cpu`` in the masters' dtype the partition already is a host buffer
    holding the master's values, so the optimizer steps it in place instead of a copy (one
    master less of host memory); the write-back of a sub-group is then a copy onto itself.
    """
    home = getattr(unit, "home", None)
    return isinstance(home, HostHome) and home.partition.dtype == master_dtype


def follow_partitions(offload: HostOffload, sharded: ShardedModule, units: Sequence[int]) -> None:
    """The host (or file) masters of ``units`` take their partitions' hand-written values.

    `GatheredParameters` and ``partition()`` write partitions directly; the masters follow as
    `deepshard.zero._stage3_masters.follow_partition` says. Resident host masters are changed
    in place; NVMe masters are read from their files, changed and written back (moments too:
    the state moves as a whole).
    """
    offload.mirror_device_share()
    states = offload.state.whole()
    for unit in units:
        follow_partition(states[0][unit], sharded.units[unit].home.read())
    if not isinstance(offload.state, HostState):
        offload.state.load(states)
    offload.reload_device_share()
