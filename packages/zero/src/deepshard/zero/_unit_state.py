"""One stage-3 unit at run time: its partition, its gathered buffer, its gradient partition.

The unit keeps two tensors for its whole life. The *partition* (this rank's chunk of the flat
layout, in the parameter dtype) is the only persistent copy of the parameters. The *buffer*
(the whole flat layout) exists as a tensor object always, but its storage is resized to zero
bytes while the unit is released. Gathering resizes the storage back and all-gathers the
partitions into it, then points every parameter's ``.data`` at its view of the buffer;
releasing points ``.data`` at an empty tensor and frees the storage. Because the storage object
is the same each time, a view autograd saved during forward (``weight.t()`` inside ``linear``)
sees the re-gathered values in backward, as does a saved parameter, whose ``.data`` is read when
it is unpacked: the backward hooks re-gather a unit before its backward runs.

Gradients: a parameter's gradient is taken from ``param.grad`` as soon as autograd accumulated
it and kept until the unit's turn to reduce; then they are copied into one flat buffer in the
reduce dtype (zeros for parameters without a gradient, and for padding), reduce-scattered in
calls of at most ``reduce_bucket_size`` elements, and the chunk is added to the gradient
partition (in the accumulation dtype), which lives until the optimizer consumes it.

Where the partition lives between gathers is its *home* (`deepshard.zero._param_offload`): the
device, a host buffer or an NVMe file (``offload_param``); the gather reads the device copy the
home provides.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from deepshard.comm import CommHandle, CommsLogger, Group, all_gather_into_tensor, resolve_group
from deepshard.zero._param_offload import DeviceHome, HomeFactory
from deepshard.zero._units import UnitPlan
from deepshard.zero.reduction import GradientReduction, PendingReduction, reduce_bucket

__all__ = ["UnitState"]


class UnitState:
    """A unit's tensors and the collectives that move them.

    Args:
        plan: The unit.
        group: The data-parallel group it is partitioned over.
        logger: Records the all-gathers and reduce-scatters.
        home: Makes the partition's home from the device partition; ``None`` keeps it on the
            device.
    """

    def __init__(
        self,
        plan: UnitPlan,
        group: Group,
        logger: CommsLogger | None,
        home: HomeFactory | None = None,
    ) -> None:
        self.plan = plan
        self._group = resolve_group(group)
        self._logger = logger
        self.rank, self.world = self._group.rank(), self._group.size()
        layout = plan.layout
        device = plan.params[0].device if plan.params else torch.device("cpu")
        self.buffer = torch.zeros(layout.numel, dtype=plan.dtype, device=device)
        with torch.no_grad():
            for slot, param in zip(layout.slots, plan.params, strict=True):
                self.buffer[slot.offset : slot.stop].copy_(param.data.reshape(-1))
        chunk = layout.partition_numel
        partition = self.buffer[self.rank * chunk : (self.rank + 1) * chunk].clone()
        self.home = DeviceHome(partition) if home is None else home(plan.index, partition)
        self.trainable = tuple(i for i, p in enumerate(plan.params) if p.requires_grad)
        self.grad_partition: torch.Tensor | None = None
        self.pending: dict[int, torch.Tensor] = {}
        self._handle: CommHandle[torch.Tensor] | None = None
        self._source: torch.Tensor | None = None
        self.gathered = True
        self.early = False
        """Whether prefetch started the current gather before the unit was needed."""
        self._empty = torch.empty(0, dtype=plan.dtype, device=device)
        self._point_params()  # the parameters' own storage goes now (`release` frees the buffer)

    @property
    def group(self) -> torch.distributed.ProcessGroup:
        """The group the unit is partitioned and reduced over."""
        return self._group

    @property
    def partition(self) -> torch.Tensor:
        """This rank's chunk in its home (no bytes between uses when the home is a file)."""
        return self.home.partition

    @property
    def numel(self) -> int:
        """Elements of the gathered buffer (with padding)."""
        return self.plan.layout.numel

    @property
    def in_flight(self) -> bool:
        """Whether a gather was started and not waited for."""
        return self._handle is not None

    def start_gather(self, *, early: bool = False) -> None:
        """Start all-gathering the partitions into the buffer (no-op when gathered).

        Args:
            early: Prefetch starts it before the unit is needed (kept in `early`).
        """
        if self.gathered or self._handle is not None:
            return
        self.early = early
        source = self.home.source()
        storage = self.buffer.untyped_storage()
        storage.resize_(self.numel * self.buffer.element_size())
        if self.world == 1 or self.numel == 0:  # nothing to communicate
            self.buffer.copy_(source)
            self.gathered = True
            self._point_params()
            return
        self._source = source  # an offloaded partition's device copy lives until the wait
        self._handle = all_gather_into_tensor(
            source,
            group=self._group,
            output=self.buffer,
            async_op=True,
            logger=self._logger,
            log_name="zero3_all_gather_params",
        )

    def wait_gather(self) -> None:
        """Gather (if not started) and wait; afterwards the parameters are whole."""
        self.start_gather()
        if self._handle is not None:
            self._handle.wait()
            self._handle, self._source = None, None
            self.gathered = True
            self._point_params()

    def _point_params(self) -> None:
        for slot, param in zip(self.plan.layout.slots, self.plan.params, strict=True):
            param.data = self.buffer[slot.offset : slot.stop].view(slot.shape)

    def release(self) -> None:
        """Free the gathered buffer; parameters on it become empty tensors of their dtype."""
        if self._handle is not None:
            self.wait_gather()
        if not self.gathered:
            return
        storage = self.buffer.untyped_storage().data_ptr()
        for param in self.plan.params:
            # a parameter given storage of its own (``partition(free_data=False)``) keeps it
            if param.data.untyped_storage().data_ptr() == storage:
                param.data = self._empty
        self.buffer.untyped_storage().resize_(0)
        self.gathered = self.early = False

    def take_grad(self, slot_index: int, grad: torch.Tensor) -> None:
        """Keep one parameter's gradient of this pass until the unit reduces."""
        self.pending[slot_index] = grad

    def launch_reduce(
        self,
        reduction: GradientReduction,
        *,
        accum_dtype: torch.dtype | None,
        bucket_numel: int,
        async_op: bool,
    ) -> Callable[[], None]:
        """Reduce-scatter this pass's gradients; the returned call adds the chunk to the
        gradient partition."""
        layout = self.plan.layout
        comm_dtype = reduction.comm_dtype(self.plan.dtype)
        flat = torch.zeros(layout.numel, dtype=comm_dtype, device=self.buffer.device)
        for index, grad in self.pending.items():
            slot = layout.slots[index]
            flat[slot.offset : slot.stop].copy_(grad.reshape(-1))
        self.pending.clear()
        chunk = layout.partition_numel
        per_call = max(layout.alignment, bucket_numel // self.world)
        per_call -= per_call % layout.alignment
        rows = flat.view(self.world, chunk)
        calls: list[tuple[int, PendingReduction]] = []
        for lo in range(0, chunk, per_call):
            hi = min(lo + per_call, chunk)
            piece = flat if hi - lo == chunk else rows[:, lo:hi].contiguous().view(-1)
            pending = reduce_bucket(
                piece,
                group=self._group,
                reduction=reduction,
                scatter=True,
                async_op=async_op,
                logger=self._logger,
            )
            calls.append((lo, pending))

        def finish() -> None:
            if self.grad_partition is None:
                dtype = accum_dtype or self.plan.dtype
                self.grad_partition = torch.zeros(chunk, dtype=dtype, device=flat.device)
            for lo, pending in calls:
                out = pending.wait()
                self.grad_partition[lo : lo + out.numel()].add_(out)

        return finish
