"""One unit's model parameters, living in one flat buffer laid out by a `FlatLayout`.

Each parameter's ``.data`` is re-pointed at its slot of the buffer (its values copied first), so
the model keeps its ``nn.Parameter`` objects, hooks and names, and every update of the buffer
is an update of the model. This rank's fp32 master partition is cut from the buffer; after the
optimizer step the updated partitions come back in bulk: copied (one partition, stage 0) or
all-gathered from every rank (stages 1-2), straight into the buffer where a call covers exactly
one bucket, through a staging tensor otherwise. An fp32 buffer that is not partitioned (stage 0,
or a group of one rank) *is* its own master: the optimizer steps the parameters in place, with
no second copy and nothing to copy back.

The inner optimizer sees a master partition as views of at most `MASTER_VIEW_NUMEL` elements
(`master_views`). For an element-wise optimizer that changes nothing in the arithmetic, but it
bounds the temporaries torch's optimizers allocate per tensor (``sqrt(v)``, the quotient...): a
40 MB temporary is above glibc's largest ``mmap`` threshold (32 MB), so it would be mapped and
page-faulted afresh at every step (48 ms for AdamW on 10.5M elements on one core, against 14 ms
in 1 MB views that stay in the heap and in cache).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from deepshard.comm import CommsLogger, Group, all_gather_into_tensor
from deepshard.interface.errors import ConfigError
from deepshard.zero.layout import FlatLayout, GatherCall, gather_copies

__all__ = [
    "MASTER_VIEW_NUMEL",
    "FlatParams",
    "common_dtype_and_device",
    "master_views",
]

MASTER_VIEW_NUMEL = 1 << 18
"""Most elements of one master view the inner optimizer steps (1 MiB of fp32)."""


def master_views(
    master: torch.Tensor, max_numel: int | None
) -> list[tuple[torch.Tensor, int, int]]:
    """``master`` cut into consecutive views of at most ``max_numel`` elements.

    Args:
        master: A 1-D master partition.
        max_numel: The most elements per view (a multiple of the alignment keeps every view
            aligned); ``None`` for the whole partition as one tensor.

    Returns:
        ``(view, lo, hi)``: each view and its ``[lo, hi)`` range of ``master``; ``master`` itself
        when it fits in one view.
    """
    numel = master.numel()
    if max_numel is None or numel <= max_numel:
        return [(master, 0, numel)]
    bounds = [(lo, min(lo + max_numel, numel)) for lo in range(0, numel, max_numel)]
    return [(master[lo:hi], lo, hi) for lo, hi in bounds]


def common_dtype_and_device(
    params: Sequence[torch.Tensor], group_index: int
) -> tuple[torch.dtype, torch.device]:
    """The one dtype and device of a param group's trainable parameters.

    Raises:
        ConfigError: The parameters mix dtypes or devices (one flat buffer cannot hold them).
    """
    dtypes = {p.dtype for p in params}
    devices = {p.device for p in params}
    if len(dtypes) > 1 or len(devices) > 1:
        raise ConfigError(
            f"param group {group_index} mixes dtypes {sorted(map(str, dtypes))} or devices "
            f"{sorted(map(str, devices))}; ZeRO keeps each group in one flat buffer, so cast the "
            "model to one dtype and device, or put differing parameters in separate groups"
        )
    if not params:
        return torch.float32, torch.device("cpu")
    dtype, device = params[0].dtype, params[0].device
    if not dtype.is_floating_point:
        raise ConfigError(
            f"param group {group_index} holds {dtype} parameters; ZeRO trains floating-point "
            "parameters only (set requires_grad=False on the others)"
        )
    return dtype, device


class FlatParams:
    """A unit's trainable parameters re-pointed into one flat buffer (`deepshard.zero._resident`).

    Args:
        params: The trainable parameters, in layout order (one dtype and device).
        layout: Their layout.
        dtype: The parameters' dtype.
        device: Their device.
    """

    def __init__(
        self,
        params: Sequence[torch.nn.Parameter],
        layout: FlatLayout,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.layout = layout
        self.buffer = torch.zeros(layout.numel, dtype=dtype, device=device)
        with torch.no_grad():
            for param, slot in zip(params, layout.slots, strict=True):
                view = self.buffer[slot.offset : slot.stop].view(slot.shape)
                view.copy_(param.detach())
                param.data = view

    def master_partition(self, rank: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """This rank's master in ``dtype`` (fp32, or 16-bit masters): its chunk of every bucket,
        back to back.

        A fresh copy, except for an unpartitioned buffer already in ``dtype``, which is its own
        master.
        """
        layout = self.layout
        if layout.world_size == 1 and self.buffer.dtype == dtype:
            return self.buffer
        master = torch.zeros(layout.partition_numel, dtype=dtype, device=self.buffer.device)
        for bucket in layout.buckets:
            chunk = layout.chunk_numel(bucket)
            start = layout.chunk_start(bucket, rank)
            master[bucket.local_start : bucket.local_start + chunk].copy_(
                self.buffer[start : start + chunk]
            )
        return master

    def copy_from(self, master: torch.Tensor) -> None:
        """Write the whole (unpartitioned, stage 0) master into the parameters (nothing to do
        when the buffer is its own master)."""
        if self.layout.world_size != 1:
            raise ValueError(
                f"FlatParams.copy_from writes a whole master into an unpartitioned layout, but "
                f"this one is partitioned over {self.layout.world_size} ranks; use gather_from"
            )
        if master is not self.buffer:
            self.buffer.copy_(master)

    def gather_from(
        self,
        master: torch.Tensor,
        calls: Sequence[GatherCall],
        *,
        group: Group,
        logger: CommsLogger | None = None,
    ) -> None:
        """All-gather every rank's updated master partition into the parameters.

        Args:
            master: This rank's fp32 partition.
            calls: How to cut the partition into all-gathers (`plan_gather_calls`).
            group: The data-parallel group the layout is partitioned over.
            logger: Records each all-gather.
        """
        world = self.layout.world_size
        pending = []
        for call in calls:
            send = master[call.local_start : call.local_stop].to(self.buffer.dtype)
            if call.bucket is not None:
                bucket = self.layout.buckets[call.bucket]
                out = self.buffer[bucket.start : bucket.stop]
            else:
                out = send.new_empty(world * call.numel)
            handle = all_gather_into_tensor(
                send,
                group=group,
                output=out,
                async_op=True,
                logger=logger,
                log_name="zero_all_gather_params",
            )
            pending.append((call, handle))
        for call, handle in pending:
            gathered = handle.wait()
            if call.bucket is None:
                for src, dst, length in gather_copies(self.layout, call):
                    self.buffer[dst : dst + length].copy_(gathered[src : src + length])
