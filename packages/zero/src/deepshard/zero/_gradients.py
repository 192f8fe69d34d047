"""Where gradients go after autograd produces them, and how they are reduced, per ZeRO stage.

Both stores take each parameter's gradient from its post-accumulate-grad hook (the parameter's
``.grad`` is released right after) and reduce bucket by bucket through a `BucketScheduler`, so
reductions overlap with the rest of backward.

* `AccumulatedGradients` (stages 0 and 1) keeps a full flat gradient buffer laid out like the
  parameters, in the accumulation dtype. Micro-steps before the accumulation boundary only add
  into it. During the boundary's backward each full bucket is all-reduced in place (stage 0) or
  reduce-scattered into this rank's fp32 gradient partition (stage 1). Overlapping costs no
  memory here, so it is always on. The buffer is not zero-filled after a step: it is marked
  stale, and the first pass after that copies each parameter's first gradient into its slot
  (a second one in the same pass adds) and zeroes the slots that got none (before their bucket
  is reduced, or when the pass ends), so the accumulated sums are the same as adding onto zeros
  (the padding is never written by a gradient and stays zero). That saves a write of the whole
  buffer and a read of it per step. Stage 1's fp32 partition is allocated once and reused: the
  boundary's reductions overwrite every element of it.
* `PartitionedGradients` (stage 2, `deepshard.zero._partitioned_gradients`) keeps only this
  rank's partition, in the accumulation dtype. Every micro-step, each bucket's gradients are
  copied into a bucket-sized staging tensor (in the communication dtype), reduce-scattered, and
  the chunk is added to the partition; the staging tensor then goes back to a pool that the
  pass's later buckets of the same size reuse and that is freed when the pass ends. A staging
  tensor is never zero-filled: each parameter's first gradient of the pass is copied into its
  slot, the padding between slots is zeroed when the tensor is taken, and the slots of
  parameters that got no gradient when the bucket is launched (a fresh 16 MiB ``torch.zeros``
  per bucket and pass cost ~10 ms on the bench box, page faults included). So gradients are
  reduced at every micro-step, as DeepSpeed's stage 2 does, and no rank ever holds more than a
  few buckets of full gradients. With ``overlap_comm`` the reductions run asynchronously, at
  most two in flight; without it each runs to completion inside the hook.

Buckets whose parameters got no gradient are reduced at the end of the pass with zeros there.

**A group of one rank** (pure tensor parallelism, where the dense data-parallel group is one rank
per TP slice, or a world of one) has nothing to combine, so its layouts skip the reduction
entirely (`GradientStore.solo`): no staging copy, no cast to the communication dtype, no
collective. Stage 0 and 1 gradients stay in the accumulation buffer, which at stage 1 is also the
(whole, fp32) partition when the buffer is fp32; stage 2 adds each gradient straight into its
partition accumulator, which is then the whole layout. The norm, clipping and overflow check read
the same partitions as before (`partition_grads`).

These stores see only ordinary param groups: the groups under a full-gradient transform (Muon)
have a store of their own, `deepshard.zero._full_grad_store.FullGroupGradients`, and
`deepshard.zero._full_grad_store.SplitGradients` routes each group to its store.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from deepshard.comm import CommsLogger, Group, resolve_group
from deepshard.zero._scheduler import BucketScheduler, Finish
from deepshard.zero.layout import FlatLayout, ParamSlot
from deepshard.zero.reduction import GradientReduction, PendingReduction, reduce_bucket

__all__ = [
    "AccumulatedGradients",
    "GradientStore",
    "StoreSettings",
    "launch_order",
]

BucketKey = tuple[int, int]
"""(param group index, bucket index)."""


@dataclass(frozen=True)
class StoreSettings:
    """What a gradient store needs besides the layouts.

    Attributes:
        device: Where the buffers live.
        group: The data-parallel group.
        reduction: How buckets are combined.
        use_reduce_scatter: ``zero_optimization.reduce_scatter`` (else all-reduce and slice).
        accum_dtype: Dtype gradients are accumulated in; ``None`` uses each group's grad dtype.
        master_dtype: Dtype of the master partitions, so of the reduced gradients the store hands
            to the optimizer: fp32, or 16 bits with the ``*_master_weights_and_grads`` switches.
        logger: Records every collective.
        param_positions: Each trainable parameter's index in the model's registration order,
            per group; decides the launch order (see `launch_order`).
        layout_groups: Each layout's own group (expert units reduce over theirs), ``None``:
            every layout reduces over ``group``. One scheduler orders the buckets of every
            group, so all ranks issue the collectives of each group in the same order.
    """

    device: torch.device
    group: Group
    reduction: GradientReduction
    use_reduce_scatter: bool = True
    accum_dtype: torch.dtype | None = None
    master_dtype: torch.dtype = torch.float32
    logger: CommsLogger | None = None
    param_positions: tuple[tuple[int, ...], ...] | None = None
    layout_groups: tuple[Group, ...] | None = None

    def group_of(self, layout: int) -> Group:
        """The group layout ``layout``'s buckets are reduced over."""
        return self.group if self.layout_groups is None else self.layout_groups[layout]


def launch_order(
    layouts: Sequence[FlatLayout], positions: Sequence[Sequence[int]] | None = None
) -> list[BucketKey]:
    """Bucket keys in the order their gradients are expected to be complete during backward.

    Backward produces gradients roughly in reverse order of the parameters' use in forward,
    approximated by their registration order in the model (``positions``: each trainable
    parameter's index in ``model.named_parameters()``, per group). A bucket is complete when its
    earliest parameter has its gradient, so buckets go latest-earliest-parameter first. Without
    positions, reverse buffer order is used (the param groups' own order).
    """
    keys = [(g, b.index) for g, layout in enumerate(layouts) for b in layout.buckets]
    if positions is None:
        return keys[::-1]

    def earliest(key: BucketKey) -> tuple[int, int, int]:
        g, b = key
        slots = layouts[g].buckets[b].slots
        first = min((positions[g][i] for i in slots), default=-1)
        return (first, g, b)

    return sorted(keys, key=earliest, reverse=True)


def _in(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``tensor`` itself when it is already ``dtype``, else a copy in ``dtype``."""
    return tensor if tensor.dtype == dtype else tensor.to(dtype)


def _done() -> None:
    """The finish of a bucket that needs no reduction (a group of one rank)."""


class GradientStore(ABC):
    """What the stores share: settings, the bucket scheduler, and the interface the optimizer uses.

    Args:
        layouts: One layout per param group.
        grad_dtypes: The gradients' (model) dtype per group.
        settings: Device, group, reduction arithmetic, logger.
        max_inflight: Passed to the scheduler.
    """

    def __init__(
        self,
        layouts: Sequence[FlatLayout],
        grad_dtypes: Sequence[torch.dtype],
        settings: StoreSettings,
        *,
        max_inflight: int | None,
    ) -> None:
        self.layouts = list(layouts)
        self.settings = settings
        self.accum_dtypes = [settings.accum_dtype or dtype for dtype in grad_dtypes]
        self.comm_dtypes = [settings.reduction.comm_dtype(dtype) for dtype in grad_dtypes]
        members = {
            (g, b.index): len(b.members) for g, layout in enumerate(layouts) for b in layout.buckets
        }
        order = launch_order(layouts, settings.param_positions)
        self.scheduler = BucketScheduler(order, members, self._launch, max_inflight)
        self.rank = resolve_group(settings.group).rank()
        self.solo = [resolve_group(settings.group_of(g)).size() == 1 for g in range(len(layouts))]
        """Per layout: its group is one rank, so its gradients are never reduced."""

    reduces_every_pass = False
    """Whether every pass reduces into the partitions (else only the boundary pass does, and a
    cycle that ended without one needs an empty boundary pass: `BackwardPasses.close_cycle`)."""

    @abstractmethod
    def begin(self, *, boundary: bool) -> None:
        """Start a backward pass; ``boundary`` says whether the optimizer steps after it."""

    @abstractmethod
    def add(self, group_index: int, slot: ParamSlot, grad: torch.Tensor) -> None:
        """Take one parameter's gradient of this pass."""

    @abstractmethod
    def _launch(self, key: BucketKey) -> Finish:
        """Start reducing one bucket; return what finishes it."""

    @abstractmethod
    def partition_grads(self) -> list[torch.Tensor]:
        """This rank's reduced gradients per group in the masters' dtype, laid out like its
        master partitions."""

    @abstractmethod
    def clear(self) -> None:
        """Forget the accumulated gradients (after a step or a skipped step)."""

    @abstractmethod
    def tensors(self) -> list[torch.Tensor]:
        """Every gradient tensor this store holds right now."""

    @abstractmethod
    def grad_partition(self, group_index: int) -> torch.Tensor | None:
        """The group's reduced gradient laid out like its master partition, if it exists now."""

    @abstractmethod
    def state_tensors(self) -> dict[str, list[torch.Tensor]]:
        """The tensors held now by ``offload_states`` type (``lp_grads``: the partitions,
        ``contiguous_grad_buffer``: full or staging buffers)."""

    def missing(self) -> list[tuple[BucketKey, int]]:
        """Buckets and how many of their parameters got no gradient in this pass."""
        return self.scheduler.missing()

    def finish(self) -> None:
        """End the pass: reduce what is left and wait for every reduction."""
        self.scheduler.flush()

    def nbytes(self) -> int:
        """Bytes of gradient storage this rank holds right now."""
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def _zeros(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(numel, dtype=dtype, device=self.settings.device)

    def _reduce(
        self,
        bucket: torch.Tensor,
        layout: int,
        *,
        scatter: bool,
        output: torch.Tensor | None = None,
        async_op: bool = True,
    ) -> PendingReduction:
        s = self.settings
        return reduce_bucket(
            bucket,
            group=s.group_of(layout),
            reduction=s.reduction,
            scatter=scatter,
            use_reduce_scatter=s.use_reduce_scatter,
            output=output,
            async_op=async_op,
            logger=s.logger,
        )


class AccumulatedGradients(GradientStore):
    """Stages 0-1: a full local gradient buffer, reduced during the boundary's backward.

    Args:
        layouts: One layout per param group.
        grad_dtypes: The gradients' dtype per group.
        settings: Device, group, reduction arithmetic, logger.
        partitioned: Stage 1 (reduce-scatter into fp32 partitions) rather than stage 0.
    """

    def __init__(
        self,
        layouts: Sequence[FlatLayout],
        grad_dtypes: Sequence[torch.dtype],
        settings: StoreSettings,
        *,
        partitioned: bool,
    ) -> None:
        super().__init__(layouts, grad_dtypes, settings, max_inflight=None)
        self.partitioned = partitioned
        self.buffers = [
            self._zeros(layout.numel, dtype)
            for layout, dtype in zip(self.layouts, self.accum_dtypes, strict=True)
        ]
        self.partitions: list[torch.Tensor] | None = None
        self._stale = False
        """The buffers hold a spent step's gradients: the next pass overwrites them."""
        self._fresh = False
        """This pass writes the first gradients since the last step."""
        self._boundary = False

    def begin(self, *, boundary: bool) -> None:
        self.scheduler.begin(reducing=boundary)
        self._fresh = self._stale
        self._boundary = boundary
        if boundary and self.partitioned and self.partitions is None:
            master = self.settings.master_dtype
            self.partitions = [
                buffer
                if solo and buffer.dtype == master  # one rank: the buffer is the partition
                else self._zeros(lay.partition_numel, master)
                for lay, buffer, solo in zip(self.layouts, self.buffers, self.solo, strict=True)
            ]

    def add(self, group_index: int, slot: ParamSlot, grad: torch.Tensor) -> None:
        key = (group_index, slot.bucket)
        piece = self.buffers[group_index][slot.offset : slot.stop]
        if self._fresh and not self.scheduler.has_arrived(key, slot.index):
            piece.copy_(grad.reshape(-1))
        else:
            piece.add_(grad.reshape(-1))
        self.scheduler.arrived(key, slot.index)

    def _zero_absent(self, key: BucketKey) -> None:
        """In a fresh pass: zero the stale slots of bucket ``key`` that got no gradient."""
        g, b = key
        layout = self.layouts[g]
        for index in self.scheduler.absent(key, layout.buckets[b].members):
            slot = layout.slots[index]
            self.buffers[g][slot.offset : slot.stop].zero_()

    def _launch(self, key: BucketKey) -> Finish:
        g, b = key
        layout = self.layouts[g]
        bucket = layout.buckets[b]
        if self._fresh:
            self._zero_absent(key)
        view = self.buffers[g][bucket.start : bucket.stop]
        if self.partitioned:
            assert self.partitions is not None, "begin(boundary=True) allocates the partitions"
            chunk = layout.chunk_numel(bucket)
            target = self.partitions[g][bucket.local_start : bucket.local_start + chunk]
        if self.solo[g]:
            if self.partitioned and target.data_ptr() != view.data_ptr():
                target.copy_(view)  # a buffer into its partition of another dtype
            return _done
        comm = view.to(self.comm_dtypes[g])  # the view itself when the dtypes agree
        if not self.partitioned:
            target = view
            pending = self._reduce(comm, g, scatter=False)
        else:
            direct = comm.dtype == target.dtype and self.settings.use_reduce_scatter
            pending = self._reduce(comm, g, scatter=True, output=target if direct else None)

        def finish() -> None:
            result = pending.wait()
            if result is not target:
                target.copy_(result)

        return finish

    def partition_grads(self) -> list[torch.Tensor]:
        if self.partitioned:
            assert self.partitions is not None, "a boundary pass fills the partitions"
            return self.partitions
        return [_in(buffer, self.settings.master_dtype) for buffer in self.buffers]

    def finish(self) -> None:
        super().finish()
        if self._fresh and not self._boundary:  # a boundary pass zeroed them before reducing
            for key, _ in self.missing():
                self._zero_absent(key)
        if self._fresh:
            self._fresh = self._stale = False

    def clear(self) -> None:
        self._stale = True  # the next pass overwrites; the partitions are reused

    def tensors(self) -> list[torch.Tensor]:
        return self.buffers + (self.partitions or [])

    def grad_partition(self, group_index: int) -> torch.Tensor | None:
        if not self.partitioned:
            return self.buffers[group_index]
        return None if self.partitions is None else self.partitions[group_index]

    def state_tensors(self) -> dict[str, list[torch.Tensor]]:
        return {"lp_grads": list(self.partitions or []), "contiguous_grad_buffer": self.buffers}
