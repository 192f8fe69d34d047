"""ZeRO over tensor-parallel parameters: partial gradients summed over ``tp``, the norm split.

Under tensor parallelism (`deepshard.interface.ParamPlacement` with ``Shard(dim)`` on ``tp``)
ZeRO changes nothing about *where* it partitions: every parameter is partitioned and reduced
over its data-parallel group (``dp × ep × sp``), which never contains the ``tp`` axis, so each
tensor-parallel slice is one ZeRO problem of its own and stage-3 gathers stay within it. Two
things do need the ``tp`` group, both at the step, on this rank's reduced gradient partitions:

* **Partial gradients.** A parameter replicated over ``tp`` whose every rank computes only a
  part of its gradient (Qwen3's ``q_norm``/``k_norm``, applied to each rank's own heads) names
  ``tp`` in ``sum_over``. Summing over ``tp`` commutes with ZeRO's average over the
  data-parallel group, so it is done once after ZeRO's reduction, on the partition: the ranks
  of one tensor-parallel group lay their units out identically (equal local shapes), so the
  parameter occupies the same range of the same partition on each of them. All such ranges
  travel in one all-reduce (`TensorParallelGrads.sum_partials`).
* **The norm.** Sliced parameters' ``Σ|g|^p`` is summed over ``tp``; replicated ones (after
  the sum above they are equal on every ``tp`` rank) are counted once
  (`deepshard.zero.norms.global_grad_norm` with ``replicated=`` and ``tp_group=``), and the
  overflow flag is combined over ``tp`` so the group skips a step together.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from deepshard.comm import CommsLogger, ParallelDims, all_reduce, resolve_group
from deepshard.interface import ParamPlacement, PlacementRegistry, Shard
from deepshard.interface.errors import ConfigError
from deepshard.zero._shards import ParamShard

if TYPE_CHECKING:
    from deepshard.zero._resident import ResidentModule
    from deepshard.zero._sharded import ShardedModule

__all__ = [
    "Range",
    "TensorParallelGrads",
    "needs_tp",
    "resident_tp_grads",
    "shard_entries",
    "sharded_tp_grads",
    "tp_grads",
    "tp_group_for",
    "tp_problems",
]

Range = tuple[int, int]
"""``[lo, hi)`` of a gradient partition."""


def needs_tp(placements: PlacementRegistry | None) -> bool:
    """Whether the placements slice or partially sum some parameter over a ``tp`` axis > 1."""
    if placements is None or placements.topology.tp == 1:
        return False
    return any(
        isinstance(p.placement("tp"), Shard) or "tp" in p.sum_over for p in placements.values()
    )


def tp_group_for(
    placements: PlacementRegistry | None, parallel_dims: ParallelDims | None
) -> torch.distributed.ProcessGroup | None:
    """The ``tp`` process group ZeRO's step needs, or ``None`` without tensor parallelism.

    Raises:
        ConfigError: The placements use ``tp`` but no `ParallelDims` owns its group.
    """
    if not needs_tp(placements):
        return None
    if parallel_dims is None:
        raise ConfigError(
            "the placements shard parameters over tp (tensor parallelism), so ZeRO needs the "
            "tp group for the gradient norm: call deepshard.zero.shard(model, "
            "parallel_dims=dims, placements=...) instead of passing group="
        )
    return resolve_group(parallel_dims.tp)


def _merged(ranges: Iterable[Range]) -> tuple[Range, ...]:
    out: list[list[int]] = []
    for lo, hi in sorted(r for r in ranges if r[1] > r[0]):
        if out and lo <= out[-1][1]:
            out[-1][1] = max(out[-1][1], hi)
        else:
            out.append([lo, hi])
    return tuple((lo, hi) for lo, hi in out)


def _complement(ranges: Sequence[Range], numel: int) -> tuple[Range, ...]:
    out, at = [], 0
    for lo, hi in ranges:
        if lo > at:
            out.append((at, lo))
        at = hi
    if at < numel:
        out.append((at, numel))
    return tuple(out)


@dataclass(frozen=True)
class TensorParallelGrads:
    """Which ranges of each gradient partition are replicated over ``tp`` or partial sums.

    Attributes:
        group: The tensor-parallel process group.
        replicated: Per partition, the ranges of parameters every ``tp`` rank holds alike
            (after `sum_partials`), merged and sorted.
        partial: Per partition, the ranges of parameters whose placement sums over ``tp``.
    """

    group: torch.distributed.ProcessGroup
    replicated: tuple[tuple[Range, ...], ...]
    partial: tuple[tuple[Range, ...], ...]

    def sum_partials(
        self, grads: Sequence[torch.Tensor], logger: CommsLogger | None = None
    ) -> None:
        """Sum the partial gradients over ``tp`` in place (one all-reduce; none if there are
        none)."""
        pieces = [
            g[lo:hi] for g, ranges in zip(grads, self.partial, strict=True) for lo, hi in ranges
        ]
        if not pieces:
            return
        flat = torch.cat(pieces)
        all_reduce(flat, group=self.group, logger=logger, log_name="zero_tp_partial_grads")
        at = 0
        for piece in pieces:
            piece.copy_(flat[at : at + piece.numel()])
            at += piece.numel()

    def split(self, grads: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """``(sliced, replicated)`` views of ``grads``: sliced over ``tp``, and alike on it."""
        sliced, replicated = [], []
        for grad, ranges in zip(grads, self.replicated, strict=True):
            replicated += [grad[lo:hi] for lo, hi in ranges]
            sliced += [grad[lo:hi] for lo, hi in _complement(ranges, grad.numel())]
        return sliced, replicated


def tp_grads(
    group: torch.distributed.ProcessGroup | None,
    entries: Iterable[tuple[int, int, int, ParamPlacement]],
    partitions: int,
) -> TensorParallelGrads | None:
    """The ranges of every partition, from ``(partition, lo, hi, placement)`` per parameter.

    Args:
        group: The ``tp`` group (`tp_group_for`); ``None`` gives ``None``.
        entries: Each parameter's range ``[lo, hi)`` in this rank's gradient partition number
            ``partition`` and its placement.
        partitions: How many gradient partitions there are (one per unit).
    """
    if group is None:
        return None
    replicated: list[list[Range]] = [[] for _ in range(partitions)]
    partial: list[list[Range]] = [[] for _ in range(partitions)]
    for index, lo, hi, placement in entries:
        if isinstance(placement.placement("tp"), Shard):
            continue
        replicated[index].append((lo, hi))
        if "tp" in placement.sum_over:
            partial[index].append((lo, hi))
    return TensorParallelGrads(group, tuple(map(_merged, replicated)), tuple(map(_merged, partial)))


def shard_entries(
    shards: Iterable[ParamShard], ranks: Sequence[int]
) -> Iterator[tuple[int, int, int, ParamPlacement]]:
    """`tp_grads`'s entries from the masters' shard maps (stages 0-2): this rank's pieces.

    A shard map counts ranks within its unit's own reduction group (an expert unit's ``dp``,
    not the dense group), so ``ranks`` is this rank's partition of every unit, by unit index.
    """
    for shard in shards:
        rank = ranks[shard.group_index]
        for piece in shard.shard_map.pieces:
            if piece.rank == rank:
                lo = piece.local_offset
                yield shard.group_index, lo, lo + piece.numel, shard.placement


def resident_tp_grads(
    resident: ResidentModule, shards: Sequence[ParamShard]
) -> TensorParallelGrads | None:
    """`tp_grads` of a stage 0-2 model from its masters' shard maps."""
    entries = shard_entries(shards, resident.partition_ranks)
    return tp_grads(resident.tp_group, entries, len(resident.units))


def sharded_tp_grads(sharded: ShardedModule) -> TensorParallelGrads | None:
    """`tp_grads` of a stage-3 model from its parameters' `ShardInfo` (this rank's ranges)."""
    infos = [
        sharded.shard_info(p) for plan in sharded.plans for p in plan.params if p.requires_grad
    ]
    entries = (
        (i.unit, i.local_offset, i.local_offset + i.local_numel, i.shard.placement) for i in infos
    )
    return tp_grads(sharded.tp_group, entries, len(sharded.plans))


def tp_problems(
    sharded: ResidentModule | ShardedModule | None, *, transformed: bool
) -> list[tuple[str, str]]:
    """``(key, message)`` for what ZeRO does not run over tensor-parallel parameters yet."""
    if sharded is None or sharded.tp_group is None or not transformed:
        return []
    return [
        (
            "optimizer.type",
            "Muon under tensor parallelism is not supported: Newton-Schulz needs each full "
            "matrix, and a TP rank holds a slice (a gather across tp per step is not built); "
            "use AdamW, or train without tensor_parallel.autotp_size",
        )
    ]
