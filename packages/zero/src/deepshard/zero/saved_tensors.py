"""Activation offload: what autograd saves during the forward lives on the host until backward.

`offload_saved_tensors` is a context manager built on `torch.autograd.graph.saved_tensors_hooks`.
Every tensor autograd saves for the backward pass while it is active goes through ``pack``,
which decides what to do with it, and comes back through ``unpack`` when backward needs it:

1. **Kept as it is** (the saved reference itself is returned): a parameter (an
   ``nn.Parameter`` or any leaf that requires grad) or a view of one, since its storage stays
   on the device for the optimizer anyway and a host copy would free nothing; a tensor whose
   whole storage holds fewer than ``min_numel`` elements (the copy would cost more than it
   frees); and what has no plain storage to copy (sparse or other non-strided layouts, tensor
   subclasses such as DTensor, meta tensors).
2. **Offloaded** otherwise, by *storage*, not by tensor. A saved tensor is often a view
   (``x.t()``, one of ``qkv.chunk(3)``, the same activation saved by two consumers), and
   several saved views may share one storage. The first time a storage is seen its bytes are
   copied once into a host buffer (pinned through the accelerator's ``pin_empty``, the copy
   asynchronous where the device has pinned memory); the saved view keeps only that buffer
   and its own size, stride and storage offset, and the device reference is dropped, so the
   device frees the storage once the forward's own references are gone. Every later saved
   view of the same storage reuses the record: the storage is offloaded once, never copied
   per view. A view that is the sole saved holder of its storage is simply the first and only
   user of its record.
3. **Unpack** copies the host bytes back to the tensor's device once per record (the restored
   bytes are held until every view saved with them has been unpacked, then only weakly) and
   rebuilds each view with ``as_strided`` from its size, stride and offset, bit-identical to
   what was saved.

A storage is recognised by a weak reference to it (`torch.multiprocessing.reductions.
StorageWeakRef`): it does not keep the device memory alive, and while it exists no other
storage can take its identity. Views share their base's version counter, so a storage written
in place after it was copied (say, a buffer filled slice by slice) gets a fresh copy for the
views saved after the write instead of stale bytes.

Nested use works: the innermost context's hooks see what is saved inside it, and each saved
tensor is unpacked by the context that packed it. Under ``torch.utils.checkpoint`` the
reentrant variant saves the checkpointed inputs through these hooks (they are offloaded) and
the non-reentrant variant installs its own hooks for its region (its inputs are kept by the
checkpoint, not saved), so both train unchanged.

Where it cannot help it changes nothing: without grad (``torch.no_grad``, inference mode)
autograd saves nothing; kept tensors (above) pass through. With the host as the device (CPU
training) the same copies are made and the originals dropped, which is what makes the code
testable anywhere, but no memory is saved there.
"""

from __future__ import annotations

import dataclasses
import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from deepshard.accelerators import ACCELERATOR_NAMES, get_accelerator
from deepshard.interface.errors import ConfigError

__all__ = ["OffloadStats", "SavedTensorOffload", "offload_saved_tensors"]

_DEFAULT_MIN_NUMEL = 1024
"""Storages below this many elements stay on the device (4 KiB of fp32: copy overhead wins)."""


@dataclass(frozen=True)
class OffloadStats:
    """What one `SavedTensorOffload` context did, counted since it was created."""

    saved: int = 0
    """Tensors autograd saved inside the context (every call of the pack hook)."""

    offloaded: int = 0
    """Saved tensors whose data now lives on the host (the views sharing a copy included)."""

    shared: int = 0
    """Offloaded tensors that reused a host copy made for an earlier view of their storage."""

    kept_parameters: int = 0
    """Saved parameters (or views of parameters), left where they are."""

    kept_small: int = 0
    """Saved tensors whose storage is below ``min_numel`` elements, left where they are."""

    kept_other: int = 0
    """Saved tensors with no plain storage to copy (sparse, subclass, meta), left as they are."""

    host_copies: int = 0
    """Storages copied to the host (one per storage and version, whatever the number of views)."""

    host_bytes: int = 0
    """Bytes copied to the host, summed over `host_copies`."""

    restored_copies: int = 0
    """Host copies brought back to their device during backward."""

    restored_bytes: int = 0
    """Bytes copied back to the device, summed over `restored_copies`."""


class _HostStorage:
    """One storage's bytes on the host, and the device copy brought back from them."""

    def __init__(self, host: torch.Tensor, device: torch.device, version: int) -> None:
        self.host = host
        self.device = device
        self.version = version
        self.pending = 0
        """Saved views of this copy not unpacked yet: the restored bytes are held for them."""
        self.restored: torch.Tensor | None = None
        # Once every view has been unpacked, the restored bytes are only referenced weakly, so
        # they are freed as soon as backward drops the last view (a retained graph's second
        # backward restores them again).
        self.restored_weak: weakref.ref[torch.Tensor] | None = None

    def restore(self) -> tuple[torch.Tensor, bool]:
        """The device bytes for one view, and whether they had to be copied back."""
        restored = self.restored
        if restored is None and self.restored_weak is not None:
            restored = self.restored_weak()
        copied = restored is None
        if restored is None:
            restored = torch.empty(self.host.numel(), dtype=torch.uint8, device=self.device)
            restored.copy_(self.host, non_blocking=self.host.is_pinned())
            self.restored_weak = weakref.ref(restored)
        self.pending = max(self.pending - 1, 0)
        self.restored = restored if self.pending else None
        return restored, copied


@dataclass(frozen=True)
class _OffloadedView:
    """What the pack hook returns for an offloaded tensor: its storage record and geometry."""

    storage: _HostStorage
    dtype: torch.dtype
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int


def _is_parameter(tensor: torch.Tensor) -> bool:
    return isinstance(tensor, torch.nn.Parameter) or (tensor.is_leaf and tensor.requires_grad)


def _holds_parameter_storage(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a parameter or a view of one (`_base` is the view's root base)."""
    base = tensor._base
    return _is_parameter(tensor) or (base is not None and _is_parameter(base))


def _has_plain_storage(tensor: torch.Tensor) -> bool:
    plain = type(tensor) in (torch.Tensor, torch.nn.Parameter)
    return plain and tensor.layout == torch.strided and tensor.device.type != "meta"


def _storage_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The whole storage under ``tensor`` as a 1-D uint8 tensor on its device (no copy)."""
    return torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(tensor.untyped_storage())


def _check_arguments(device: torch.device | str, pin_memory: Any, min_numel: Any) -> torch.device:
    try:
        host = torch.device(device)
    except (RuntimeError, TypeError) as error:
        raise ConfigError(
            f'offload_saved_tensors(device={device!r}): not a device ({error}); use "cpu"'
        ) from None
    if host.type != "cpu":
        raise ConfigError(
            f"offload_saved_tensors(device={device!r}): saved tensors are offloaded to host "
            'memory; use device="cpu"'
        )
    if not isinstance(pin_memory, bool):
        raise ConfigError(
            f"offload_saved_tensors(pin_memory={pin_memory!r}): must be True or False"
        )
    if isinstance(min_numel, bool) or not isinstance(min_numel, int) or min_numel < 0:
        raise ConfigError(
            f"offload_saved_tensors(min_numel={min_numel!r}): must be an int >= 0 (the smallest "
            "storage, in elements, worth moving; 0 moves every one)"
        )
    return host


class SavedTensorOffload:
    """The context `offload_saved_tensors` returns; `stats` says what it did.

    Args:
        host: The host device the copies go to.
        pin_memory: Allocate the host copies page-locked where the tensor's accelerator can.
        min_numel: Storages with fewer elements than this stay where they are.
    """

    def __init__(self, host: torch.device, pin_memory: bool, min_numel: int) -> None:
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._host = host
        self._pin_memory = pin_memory
        self._min_numel = min_numel
        self._stats = OffloadStats()
        # Storage -> its host record, for the views saved later. Weak both ways: a dead device
        # storage cannot be saved again, and a record no saved view refers to is garbage.
        self._records: weakref.WeakValueDictionary[StorageWeakRef, _HostStorage] = (
            weakref.WeakValueDictionary()
        )

    @property
    def stats(self) -> OffloadStats:
        """The counts so far (a frozen snapshot)."""
        return self._stats

    def __enter__(self) -> SavedTensorOffload:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._hooks.__exit__(*exc_info)
        # Saved views keep their records alive; the lookup table is only needed while packing.
        self._records.clear()

    def _count(self, **increments: int) -> None:
        stats = self._stats
        changes = {name: getattr(stats, name) + value for name, value in increments.items()}
        self._stats = dataclasses.replace(stats, **changes)

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor | _OffloadedView:
        self._count(saved=1)
        if not _has_plain_storage(tensor):
            self._count(kept_other=1)
            return tensor
        if _holds_parameter_storage(tensor):
            self._count(kept_parameters=1)
            return tensor
        storage = tensor.untyped_storage()
        if storage.nbytes() < self._min_numel * tensor.element_size():
            self._count(kept_small=1)
            return tensor
        key = StorageWeakRef(storage)  # type: ignore[no-untyped-call]  # torch leaves it untyped
        record = self._records.get(key)
        if record is not None and record.version == tensor._version:
            self._count(offloaded=1, shared=1)
        else:
            record = self._copy_to_host(tensor)
            self._records[key] = record
            self._count(offloaded=1)
        record.pending += 1
        return _OffloadedView(
            storage=record,
            dtype=tensor.dtype,
            size=tuple(tensor.size()),
            stride=tuple(tensor.stride()),
            offset=int(tensor.storage_offset()),
        )

    def _host_buffer(self, source: torch.Tensor) -> torch.Tensor:
        """An empty host buffer for ``source``'s bytes, page-locked where its device can."""
        device_type = source.device.type
        if self._pin_memory and device_type in ACCELERATOR_NAMES:
            # Only the tensor's own accelerator pins memory for it (the CPU one pins nothing).
            return get_accelerator(device_type).pin_empty(source.numel(), dtype=torch.uint8)
        return torch.empty(source.numel(), dtype=torch.uint8, device=self._host)

    def _copy_to_host(self, tensor: torch.Tensor) -> _HostStorage:
        source = _storage_bytes(tensor)
        host = self._host_buffer(source)
        # Asynchronous only into pinned memory: the copy is queued on the current stream, so
        # the device block it reads is reused only after it (the caching allocator orders reuse
        # by stream), and the copy back in backward is queued after it too.
        host.copy_(source, non_blocking=host.is_pinned())
        self._count(host_copies=1, host_bytes=source.numel())
        return _HostStorage(host, tensor.device, tensor._version)

    def _unpack(self, packed: torch.Tensor | _OffloadedView) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        restored, copied = packed.storage.restore()
        if copied:
            self._count(restored_copies=1, restored_bytes=restored.numel())
        itemsize = torch.empty(0, dtype=packed.dtype).element_size()
        whole = restored[: restored.numel() - restored.numel() % itemsize].view(packed.dtype)
        # Autograd re-attaches the saved tensor's grad_fn and requires_grad to what unpack
        # returns, so the plain view is all it needs.
        return whole.as_strided(packed.size, packed.stride, packed.offset)


def offload_saved_tensors(
    device: torch.device | str = "cpu",
    pin_memory: bool = True,
    min_numel: int = _DEFAULT_MIN_NUMEL,
) -> SavedTensorOffload:
    """Move what autograd saves inside the ``with`` block to host memory until backward.

    Each storage is copied once, however many saved views share it; parameters, their views
    and storages below ``min_numel`` elements stay where they are (see the module docstring
    for the rule and for where it is a no-op)::

        with deepshard.zero.offload_saved_tensors() as offload:
            loss = model(batch).mean()
        loss.backward()
        print(offload.stats.host_bytes)

    Args:
        device: Where the copies go; only the host (``"cpu"``) is supported.
        pin_memory: Allocate the copies page-locked (through the accelerator's ``pin_empty``)
            where the saved tensor's accelerator can, which makes the copies asynchronous.
        min_numel: Storages with fewer elements than this are not moved.

    Returns:
        The context manager; its `SavedTensorOffload.stats` counts what it moved.

    Raises:
        ConfigError: ``device`` is not the host, ``pin_memory`` not a bool, or ``min_numel``
            not an int >= 0.
    """
    host = _check_arguments(device, pin_memory, min_numel)
    return SavedTensorOffload(host, pin_memory, min_numel)
