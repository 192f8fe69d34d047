"""Where ZeRO stage 3's fp32 masters come from and which ranges of them the optimizer steps.

A unit's master covers only the *trainable prefix* of this rank's partition
(`deepshard.zero._units.UnitPlan.trainable_numel`): frozen parameters sit at the end of the
unit's layout and get neither a master nor optimizer state. On the device an fp32 partition is
its own master (a view of its prefix); otherwise the master is a new fp32 copy, with or without
optimizer offload (`deepshard.zero._stage3_offload` keeps its copy on the host or in files),
except that an fp32 host partition (``offload_param: cpu``) is its own host master too.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from deepshard.zero._sharded import ShardedModule

__all__ = ["device_masters", "follow_partition", "master_grads", "master_ranges", "merged_ranges"]

Range = tuple[int, int, int]
"""``(unit, lo, hi)``: elements ``[lo, hi)`` of a unit's partition (and master)."""


def master_ranges(sharded: ShardedModule, group_params: Sequence[torch.Tensor]) -> list[Range]:
    """``(unit, lo, hi)`` of every trainable parameter's local piece in its unit's partition."""
    out = []
    for param in group_params:
        if not param.requires_grad:
            continue
        info = sharded.shard_info(param)
        if info.local_numel:
            out.append((info.unit, info.local_offset, info.local_offset + info.local_numel))
    return sorted(out)


def merged_ranges(
    ranges: Sequence[Range], sharded: ShardedModule, max_numel: int | None
) -> list[Range]:
    """Consecutive ranges of one unit merged across padding, then cut to ``max_numel``."""
    merged: list[Range] = []
    for unit, lo, hi in ranges:
        alignment = sharded.plans[unit].layout.alignment
        if merged and merged[-1][0] == unit and lo - merged[-1][2] < alignment:
            merged[-1] = (unit, merged[-1][1], hi)
        else:
            merged.append((unit, lo, hi))
    if max_numel is None:
        return merged
    return [
        (unit, start, min(start + max_numel, hi))
        for unit, lo, hi in merged
        for start in range(lo, hi, max_numel)
    ]


def device_masters(
    sharded: ShardedModule, trainable: Sequence[int], dtype: torch.dtype = torch.float32
) -> list[tuple[torch.Tensor, bool]]:
    """Each unit's ``dtype`` master (fp32, or 16-bit masters) of its first ``trainable[unit]``
    elements, on the compute device, and whether it is a copy of its own (a device-resident
    partition already in ``dtype`` is its own master)."""
    masters = []
    for u, numel in zip(sharded.units, trainable, strict=True):
        on_device = u.home.device_bytes > 0 or u.partition.numel() == 0
        if on_device and u.partition.dtype == dtype:
            masters.append((u.partition[:numel], False))
        else:
            values = u.home.read()[:numel]
            masters.append((values.to(u.buffer.device, dtype, copy=True), True))
    return masters


def master_grads(
    partitions: Sequence[torch.Tensor | None],
    trainable: Sequence[int],
    dtype: torch.dtype,
    device: torch.device,
) -> list[torch.Tensor]:
    """Each unit's reduced gradient over its master (the first ``trainable[unit]`` elements of
    its gradient partition; zeros where it has none) in the masters' ``dtype``."""
    out = []
    for grad, numel in zip(partitions, trainable, strict=True):
        if grad is None:
            out.append(torch.zeros(numel, dtype=dtype, device=device))
        else:
            out.append(grad[:numel] if grad.dtype == dtype else grad[:numel].to(dtype))
    return out


def follow_partition(master: torch.Tensor, partition: torch.Tensor) -> None:
    """Give ``master`` the values of ``partition`` (written by hand) where they differ.

    Only elements whose partition value differs from the master rounded to it change, so an fp32
    master keeps its precision wherever a bf16 partition was not modified.
    """
    values = partition[: master.numel()].to(master.device)
    changed = master.to(values.dtype) != values
    master[changed] = values[changed].to(master.dtype)
