"""What a checkpoint keeps of its inputs: a tp partition, in a contiguous slot, on the host.

``torch.utils.checkpoint`` (non-reentrant) saves the checkpointed function's tensor inputs with
autograd's ``save_for_backward`` *before* it installs its own hooks for the region, so a
``saved_tensors_hooks`` context around the call sees exactly those inputs and nothing the
function saves inside. `InputHooks` is that context:

* ``partition_activations``: every tp rank holds the same input (the activations between
  tensor-parallel blocks are replicated), so each keeps only chunk ``tp_rank`` of the flattened
  input (the last chunk zero-padded) and the recomputation all-gathers the chunks over the tp
  group and drops the padding. Memory kept per input: ``ceil(numel / tp)`` elements.
* ``contiguous_memory_optimization``: the kept chunk is copied into a slot of a preallocated
  buffer, one buffer per input position with ``number_checkpoints`` slots (DeepSpeed's layout),
  so the chunks of a forward do not fragment the allocator. A slot is taken by the first free
  one and freed when autograd drops the saved input (after backward, or with the graph), so
  no reset call is needed between steps.
* ``cpu_checkpointing``: the kept chunk moves to host memory until the recomputation.

Gradients are untouched: autograd differentiates the original forward's graph, the inputs are
only the values the recomputation starts from.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist

from deepshard.comm import all_gather_into_tensor
from deepshard.interface.errors import ConfigError

__all__ = ["InputHooks", "SlotBuffers"]


class _Slots:
    """``count`` equal slots of one dtype and device; each is free or held by one saved input."""

    def __init__(self, count: int, numel: int, dtype: torch.dtype, device: torch.device) -> None:
        self.data = torch.empty(count, numel, dtype=dtype, device=device)
        self.holders: list[weakref.ref[object] | None] = [None] * count

    def free_slot(self) -> int | None:
        for index, holder in enumerate(self.holders):
            if holder is None or holder() is None:
                return index
        return None


class SlotBuffers:
    """The contiguous buffers, one per (input position, dtype, device), grown when needed.

    Args:
        count: Slots per buffer (``number_checkpoints``).
    """

    def __init__(self, count: int) -> None:
        self.count = count
        self._buffers: dict[tuple[int, torch.dtype, torch.device], _Slots] = {}

    def take(self, position: int, chunk: torch.Tensor, holder: object) -> torch.Tensor:
        """Copy ``chunk`` (1-D) into a free slot held until ``holder`` is collected.

        Raises:
            ConfigError: Every slot is held (more checkpoints than ``number_checkpoints``).
        """
        key = (position, chunk.dtype, chunk.device)
        slots = self._buffers.get(key)
        if slots is None or slots.data.shape[1] < chunk.numel():
            # A larger input than the buffer was sized for: start a larger buffer. Held slots
            # of the old one stay valid (their views keep its storage alive).
            slots = _Slots(self.count, chunk.numel(), chunk.dtype, chunk.device)
            self._buffers[key] = slots
        index = slots.free_slot()
        if index is None:
            raise ConfigError.from_problems(
                [
                    (
                        "activation_checkpointing.number_checkpoints",
                        f"{self.count} slots are all held by checkpointed inputs not yet used "
                        "by a backward pass; raise it to the number of checkpoint calls per "
                        "forward (or run backward before the next forward)",
                    )
                ]
            )
        view = slots.data[index, : chunk.numel()]
        view.copy_(chunk)
        slots.holders[index] = weakref.ref(holder)
        return view

    @property
    def nbytes(self) -> int:
        """Bytes of every buffer allocated so far."""
        return sum(s.data.nbytes for s in self._buffers.values())


@dataclass(eq=False)
class _KeptInput:
    """What the pack hook returns for a checkpointed input: this rank's chunk and the geometry."""

    chunk: torch.Tensor
    shape: torch.Size
    numel: int
    device: torch.device
    in_slot: bool


def _is_activation(tensor: torch.Tensor) -> bool:
    """Floating-point, non-empty, plain and not a parameter (parameters stay for the step)."""
    plain = type(tensor) is torch.Tensor and tensor.layout == torch.strided
    leaf_param = tensor.is_leaf and tensor.requires_grad
    return plain and tensor.is_floating_point() and tensor.numel() > 0 and not leaf_param


class InputHooks:
    """The saved-tensor hooks one checkpoint call puts around ``torch.utils.checkpoint``.

    Args:
        tp: The tensor-parallel group to partition over (``None``: keep inputs whole).
        slots: Where contiguous copies go (``None``: no contiguous buffer).
        to_host: Keep the chunks in host memory.
    """

    def __init__(
        self, *, tp: dist.ProcessGroup | None, slots: SlotBuffers | None, to_host: bool
    ) -> None:
        self._tp = tp
        self._slots = slots
        self._to_host = to_host
        self._position = 0
        self.kept_bytes = 0
        """Bytes of the activation inputs kept by this call (chunks after partitioning;
        parameters and the checkpoint's own empty marker are not activations)."""
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _chunk(self, tensor: torch.Tensor) -> torch.Tensor:
        flat = tensor.detach().reshape(-1)
        if self._tp is None or self._tp.size() == 1:
            return flat
        size, rank = self._tp.size(), self._tp.rank()
        per_rank = -(-flat.numel() // size)
        start = min(rank * per_rank, flat.numel())
        piece = flat[start : start + per_rank]
        if piece.numel() < per_rank:  # the last rank's chunk is padded to the common size
            piece = torch.cat([piece, piece.new_zeros(per_rank - piece.numel())])
        return piece

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor | _KeptInput:
        position, self._position = self._position, self._position + 1
        if not _is_activation(tensor):
            return tensor
        chunk = self._chunk(tensor)
        same_storage = chunk.untyped_storage().data_ptr() == tensor.untyped_storage().data_ptr()
        if same_storage and chunk.numel() != tensor.numel():  # a view would keep it all alive
            chunk = chunk.clone()
        if self._to_host:
            chunk = chunk.to("cpu")
        kept = _KeptInput(chunk, tensor.shape, tensor.numel(), tensor.device, False)
        if self._slots is not None:
            kept.chunk = self._slots.take(position, chunk, holder=kept)
            kept.in_slot = True
        self.kept_bytes += kept.chunk.nbytes
        return kept

    def _unpack(self, kept: torch.Tensor | _KeptInput) -> torch.Tensor:
        if isinstance(kept, torch.Tensor):
            return kept
        chunk = kept.chunk.to(kept.device)
        if self._tp is not None and self._tp.size() > 1:
            flat = all_gather_into_tensor(chunk.contiguous(), group=self._tp).wait()
        elif kept.in_slot and chunk.data_ptr() == kept.chunk.data_ptr():
            flat = chunk.clone()  # the slot is reused once this input is dropped: copy it out
        else:
            flat = chunk
        return flat[: kept.numel].view(kept.shape)
