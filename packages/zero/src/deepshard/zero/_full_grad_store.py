"""The gradient store of the full groups at stages 0-2, and the router in front of both stores.

*Full groups* are the param groups under a full-gradient transform (Muon's ``use_muon`` groups,
see `deepshard.zero._full_grads`): every owner of a piece of one of their parameters needs the
parameter's whole reduced gradient. `FullGroupGradients` keeps a full flat gradient buffer per
such group, in the accumulation dtype, into which every micro-step adds locally (at stage 2 too,
instead of reduce-scattering each micro-step). During the boundary's backward each bucket is
all-reduced whole, once per accumulation cycle, in place, so `FullGroupGradients.full_gradient`
can hand the transform any parameter's reduced gradient; at stages 1-2 this rank's chunk of the
bucket is then copied into its gradient partition (fp32 at stage 1, allocated for the boundary;
the accumulation dtype at stage 2, kept), which the norm, clipping and the inner optimizer read
as they read the ordinary groups' partitions.

`SplitGradients` is what the optimizer and its backward passes hold: it routes each param
group, by its index in the inner optimizer, to the ordinary store (`deepshard.zero._gradients`,
which sees only ordinary groups) or to the full groups' store, and answers for both.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch

from deepshard.zero._gradients import (
    AccumulatedGradients,
    BucketKey,
    GradientStore,
    StoreSettings,
    _in,
)
from deepshard.zero._partitioned_gradients import PartitionedGradients
from deepshard.zero._scheduler import Finish
from deepshard.zero.layout import FlatLayout, ParamSlot

__all__ = ["FullGroupGradients", "SplitGradients", "local_settings"]


def local_settings(settings: StoreSettings, groups: Sequence[int]) -> StoreSettings:
    """``settings`` for a store over only ``groups`` (its registration positions cut down)."""
    positions = settings.param_positions
    if positions is not None:
        settings = replace(settings, param_positions=tuple(positions[g] for g in groups))
    own = settings.layout_groups
    if own is not None:
        settings = replace(settings, layout_groups=tuple(own[g] for g in groups))
    return settings


class FullGroupGradients(GradientStore):
    """Full groups' gradients: accumulated whole, each bucket all-reduced once per cycle.

    Args:
        layouts: One layout per full group.
        grad_dtypes: The gradients' dtype per full group.
        settings: Device, group, reduction arithmetic, logger (positions of these groups only).
        stage: The ZeRO stage (0, 1 or 2).
        overlap: ``overlap_comm`` at stage 2 (at most two buckets in flight); stages 0-1 always
            overlap, without a limit.
    """

    def __init__(
        self,
        layouts: Sequence[FlatLayout],
        grad_dtypes: Sequence[torch.dtype],
        settings: StoreSettings,
        *,
        stage: int,
        overlap: bool,
    ) -> None:
        inflight = (2 if overlap else 0) if stage == 2 else None
        super().__init__(layouts, grad_dtypes, settings, max_inflight=inflight)
        self.stage = stage
        self.async_op = overlap or stage < 2
        self.buffers = [
            self._zeros(layout.numel, dtype)
            for layout, dtype in zip(self.layouts, self.accum_dtypes, strict=True)
        ]
        self.partitions: list[torch.Tensor] | None = None
        if stage == 2:  # kept between steps, like stage 2's ordinary accumulators
            self.partitions = [
                self._zeros(layout.partition_numel, dtype)
                for layout, dtype in zip(self.layouts, self.accum_dtypes, strict=True)
            ]
        self.boundary = False

    def begin(self, *, boundary: bool) -> None:
        # stage 2 watches every pass for gradients arriving twice, as its ordinary store does
        self.scheduler.begin(reducing=boundary or self.stage == 2)
        self.boundary = boundary
        if boundary and self.stage == 1:
            self.partitions = [
                self._zeros(lay.partition_numel, self.settings.master_dtype) for lay in self.layouts
            ]

    def add(self, group_index: int, slot: ParamSlot, grad: torch.Tensor) -> None:
        self.buffers[group_index][slot.offset : slot.stop].add_(grad.reshape(-1))
        self.scheduler.arrived((group_index, slot.bucket), slot.index)

    def _launch(self, key: BucketKey) -> Finish:
        """All-reduce one bucket in the full buffer, then copy this rank's chunk of it into the
        partition (stages 1-2); nothing before the boundary."""
        if not self.boundary:
            return lambda: None
        g, b = key
        layout = self.layouts[g]
        bucket = layout.buckets[b]
        view = self.buffers[g][bucket.start : bucket.stop]
        comm = view.to(self.comm_dtypes[g])  # the view itself when the dtypes agree
        pending = self._reduce(comm, g, scatter=False, async_op=self.async_op)
        target = None
        if self.partitions is not None:
            chunk = layout.chunk_numel(bucket)
            target = self.partitions[g][bucket.local_start : bucket.local_start + chunk]
            lo = layout.chunk_start(bucket, self.rank if layout.world_size > 1 else 0)
            lo -= bucket.start

        def finish() -> None:
            result = pending.wait()
            if result is not view:
                view.copy_(result)
            if target is not None:
                target.copy_(view[lo : lo + target.numel()])

        return finish

    def full_gradient(self, group_index: int, slot: ParamSlot) -> torch.Tensor:
        """After a boundary pass, a parameter's whole reduced gradient (loss-scaled), in the
        accumulation dtype and the parameter's shape."""
        return self.buffers[group_index][slot.offset : slot.stop].view(slot.shape)

    def partition_grads(self) -> list[torch.Tensor]:
        if self.stage == 0:
            return [_in(buffer, self.settings.master_dtype) for buffer in self.buffers]
        assert self.partitions is not None, "a boundary pass fills the partitions"
        return [_in(partition, self.settings.master_dtype) for partition in self.partitions]

    def clear(self) -> None:
        for buffer in self.buffers:
            buffer.zero_()
        if self.stage == 2:
            for partition in self.partitions or []:
                partition.zero_()
        else:
            self.partitions = None

    def tensors(self) -> list[torch.Tensor]:
        return self.buffers + (self.partitions or [])

    def grad_partition(self, group_index: int) -> torch.Tensor | None:
        if self.stage == 0:
            return self.buffers[group_index]
        return None if self.partitions is None else self.partitions[group_index]

    def state_tensors(self) -> dict[str, list[torch.Tensor]]:
        return {"lp_grads": list(self.partitions or []), "contiguous_grad_buffer": self.buffers}


class SplitGradients:
    """Routes each param group to the ordinary store or the full groups' store.

    Args:
        ordinary: The store of the ordinary groups, in their order.
        full: The store of the full groups, in their order (``None`` when there are none).
        full_flags: Per param group of the inner optimizer, whether it is a full group.
    """

    def __init__(
        self, ordinary: GradientStore, full: FullGroupGradients | None, full_flags: Sequence[bool]
    ) -> None:
        assert (full is not None) == any(full_flags), "a full store exactly for full groups"
        self.ordinary, self.full = ordinary, full
        self._route: list[tuple[GradientStore, int]] = []
        counts = [0, 0]
        for flag in full_flags:
            store = full if flag and full is not None else ordinary
            self._route.append((store, counts[flag]))
            counts[flag] += 1
        self._stores = [ordinary] if full is None else [ordinary, full]

    @property
    def settings(self) -> StoreSettings:
        """The ordinary store's settings (the reduction arithmetic is the same for both)."""
        return self.ordinary.settings

    @property
    def reduces_every_pass(self) -> bool:
        """Whether both stores reduce at every pass (the full groups' store never does: it
        all-reduces its buffer at the boundary)."""
        return all(store.reduces_every_pass for store in self._stores)

    def begin(self, *, boundary: bool) -> None:
        """Start a backward pass in both stores."""
        for store in self._stores:
            store.begin(boundary=boundary)

    def add(self, group_index: int, slot: ParamSlot, grad: torch.Tensor) -> None:
        """Take one parameter's gradient (``group_index``: the inner optimizer's group)."""
        store, local = self._route[group_index]
        store.add(local, slot, grad)

    def finish(self) -> None:
        """End the pass in both stores (the ordinary one first, on every rank alike)."""
        for store in self._stores:
            store.finish()

    def missing(self) -> list[tuple[BucketKey, int]]:
        """Buckets (keyed in their own store) and how many parameters got no gradient."""
        return [item for store in self._stores for item in store.missing()]

    def partition_grads(self) -> list[torch.Tensor]:
        """This rank's reduced fp32 gradients for every group, in the inner optimizer's order."""
        per_store = {id(store): store.partition_grads() for store in self._stores}
        return [per_store[id(store)][local] for store, local in self._route]

    def grad_partition(self, group_index: int) -> torch.Tensor | None:
        """A group's reduced gradient laid out like its master partition, if it exists now."""
        store, local = self._route[group_index]
        return store.grad_partition(local)

    def clear(self) -> None:
        """Forget the accumulated gradients in both stores."""
        for store in self._stores:
            store.clear()

    def tensors(self) -> list[torch.Tensor]:
        """Every gradient tensor both stores hold right now."""
        return [t for store in self._stores for t in store.tensors()]

    def state_tensors(self) -> dict[str, list[torch.Tensor]]:
        """Both stores' tensors by ``offload_states`` type."""
        merged: dict[str, list[torch.Tensor]] = {}
        for store in self._stores:
            for name, tensors in store.state_tensors().items():
                merged.setdefault(name, []).extend(tensors)
        return merged

    def nbytes(self) -> int:
        """Bytes of gradient storage this rank holds right now."""
        return sum(store.nbytes() for store in self._stores)


def split_store(
    settings: StoreSettings,
    full: FullGroupGradients | None,
    full_flags: Sequence[bool],
    layouts: Sequence[FlatLayout],
    dtypes: Sequence[torch.dtype],
    *,
    stage: int,
    overlap: bool,
) -> SplitGradients:
    """The ordinary groups' store behind a router that also reaches the full groups'.

    Args:
        settings: The optimizer's store settings (every group).
        full: The full groups' store, if any.
        full_flags: Per group, whether it is a full group.
        layouts: Every group's layout.
        dtypes: Every group's buffer dtype.
        stage: The ZeRO stage: 2 keeps only gradient partitions, 0-1 accumulate whole.
        overlap: ``overlap_comm`` (stage 2).
    """
    ordinary = [g for g, flag in enumerate(full_flags) if not flag]
    own = local_settings(settings, ordinary)
    mine = [layouts[g] for g in ordinary], [dtypes[g] for g in ordinary]
    store: GradientStore
    if stage == 2:
        store = PartitionedGradients(*mine, own, overlap=overlap)
    else:
        store = AccumulatedGradients(*mine, own, partitioned=stage == 1)
    return SplitGradients(store, full, full_flags)
