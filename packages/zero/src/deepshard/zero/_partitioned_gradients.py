"""Stage 2's gradient store: only this rank's partition, buckets reduced at every micro-step.

Every micro-step, each bucket's gradients are copied into a bucket-sized staging tensor (in the
communication dtype), reduce-scattered, and the chunk is added to the partition; the staging
tensor then goes back to a pool that the pass's later buckets of the same size reuse and that is
freed when the pass ends (see `deepshard.zero._gradients` for what the stores share).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from deepshard.zero._gradients import BucketKey, GradientStore, StoreSettings, _done, _in
from deepshard.zero._scheduler import Finish
from deepshard.zero.layout import Bucket, FlatLayout, ParamSlot

__all__ = ["PartitionedGradients"]


def _padding(layout: FlatLayout, bucket: Bucket) -> list[tuple[int, int]]:
    """The ranges of ``bucket`` (from its start) that no parameter's slot covers."""
    gaps, at = [], 0
    for slot in sorted((layout.slots[i] for i in bucket.slots), key=lambda s: s.offset):
        lo = slot.offset - bucket.start
        if lo > at:
            gaps.append((at, lo))
        at = max(at, lo + slot.numel)
    if at < bucket.numel:
        gaps.append((at, bucket.numel))
    return gaps


class PartitionedGradients(GradientStore):
    """Stage 2: only this rank's gradient partition; buckets reduced at every micro-step.

    Args:
        layouts: One layout per param group.
        grad_dtypes: The gradients' dtype per group.
        settings: Device, group, reduction arithmetic, logger.
        overlap: ``overlap_comm``: reduce asynchronously (at most two buckets in flight).
    """

    def __init__(
        self,
        layouts: Sequence[FlatLayout],
        grad_dtypes: Sequence[torch.dtype],
        settings: StoreSettings,
        *,
        overlap: bool,
    ) -> None:
        super().__init__(layouts, grad_dtypes, settings, max_inflight=2 if overlap else 0)
        self.overlap = overlap
        self.accumulators = [
            self._zeros(layout.partition_numel, dtype)
            for layout, dtype in zip(self.layouts, self.accum_dtypes, strict=True)
        ]
        self.staging: dict[BucketKey, torch.Tensor] = {}
        self._pool: dict[tuple[int, torch.dtype], list[torch.Tensor]] = {}
        self._gaps = [[_padding(layout, b) for b in layout.buckets] for layout in self.layouts]

    reduces_every_pass = True

    def begin(self, *, boundary: bool) -> None:
        self.scheduler.begin(reducing=True)

    def add(self, group_index: int, slot: ParamSlot, grad: torch.Tensor) -> None:
        key = (group_index, slot.bucket)
        if self.solo[group_index]:  # one rank: the partition is the whole layout
            self.accumulators[group_index][slot.offset : slot.stop].add_(grad.reshape(-1))
            self.scheduler.arrived(key, slot.index)
            return
        bucket = self.layouts[group_index].buckets[slot.bucket]
        staging = self.staging.get(key)
        if staging is None:
            staging = self._take(key)
            self.staging[key] = staging
        start = slot.offset - bucket.start
        piece = staging[start : start + slot.numel]
        if self.scheduler.has_arrived(key, slot.index):  # a second gradient in one pass
            piece.add_(grad.reshape(-1))
        else:
            piece.copy_(grad.reshape(-1))
        self.scheduler.arrived(key, slot.index)

    def _take(self, key: BucketKey) -> torch.Tensor:
        """A staging tensor for bucket ``key`` from the pool (else a new one), padding zeroed."""
        g, b = key
        size = (self.layouts[g].buckets[b].numel, self.comm_dtypes[g])
        free = self._pool.get(size)
        staging = (
            free.pop() if free else torch.empty(size[0], dtype=size[1], device=self.settings.device)
        )
        for lo, hi in self._gaps[g][b]:
            staging[lo:hi].zero_()
        return staging

    def _launch(self, key: BucketKey) -> Finish:
        g, b = key
        if self.solo[g]:
            return _done
        layout = self.layouts[g]
        bucket = layout.buckets[b]
        start = bucket.local_start
        target = self.accumulators[g][start : start + layout.chunk_numel(bucket)]
        staging = self.staging.pop(key, None)
        if staging is None:  # no parameter of the bucket got a gradient in this pass
            staging = self._take(key)
        for index in self.scheduler.absent(key, bucket.members):  # they count as zeros
            slot = layout.slots[index]
            staging[slot.offset - bucket.start : slot.stop - bucket.start].zero_()
        pending = self._reduce(staging, g, scatter=True, async_op=self.overlap)

        def finish() -> None:
            target.add_(pending.wait())
            self._pool.setdefault((staging.numel(), staging.dtype), []).append(staging)

        return finish

    def finish(self) -> None:
        super().finish()
        self._pool.clear()  # staging lives for one pass only

    def partition_grads(self) -> list[torch.Tensor]:
        return [_in(acc, self.settings.master_dtype) for acc in self.accumulators]

    def clear(self) -> None:
        for acc in self.accumulators:
            acc.zero_()
        self.staging.clear()
        self._pool.clear()

    def tensors(self) -> list[torch.Tensor]:
        return self.accumulators + list(self.staging.values())

    def grad_partition(self, group_index: int) -> torch.Tensor | None:
        return self.accumulators[group_index]

    def state_tensors(self) -> dict[str, list[torch.Tensor]]:
        staging = list(self.staging.values())
        return {"lp_grads": list(self.accumulators), "contiguous_grad_buffer": staging}
