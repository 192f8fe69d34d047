"""Moving ZeRO's states to host memory between steps and back (``offload_states``).

Between training phases (an RL rollout, an evaluation with another model) a job may want the
device memory ZeRO holds without rebuilding anything. `StateOffload.offload_states` copies the
selected tensors into host buffers and releases their device storage; `reload_states` puts the
bytes back. The state types are DeepSpeed 0.19.7's (`OFFLOAD_STATE_TYPES`):

* ``optim_states``: the inner optimizer's state tensors (and a full-gradient transform's buffers,
  Muon's momentum);
* ``hp_params``: the fp32 master partitions;
* ``lp_params``: the flat parameter buffers in the model dtype (the model's ``.data``);
* ``lp_grads``: the reduced gradient partitions (stage 1 from the first boundary pass on,
  stage 2 always; stage 0 has none, its reduced gradients live in the contiguous buffer);
* ``contiguous_grad_buffer``: the full flat gradient buffers (stages 0-1, and stage 2's buffers
  of full-gradient groups).

**Same tensor objects.** Everything else holds *views* of these tensors: the inner optimizer steps
views of the masters, the model's parameters are views of the flat buffer. Moving a tensor by
replacing its ``.data`` would leave every view on the old memory, so the storage itself is
emptied instead (``untyped_storage().resize_(0)``, as FSDP2 frees unsharded parameters) and
regrown and refilled on reload: every view sees its bytes again and training continues bit for
bit. Storages are released once each even when several state types share one (an fp32 stage-0
master *is* the parameter buffer). A zero-byte storage under a live view is a dangling pointer,
so while the parameter buffer is released the parameters point at empty tensors (a stray
forward fails with torch's shape error, not a crash), and ZeRO refuses every call that would
touch released memory (`StateOffload.check_resident`).

**Host buffers** are allocated page-locked through the accelerator's ``pin_empty`` when
``pin_memory`` (and the device can pin; the CPU cannot), as bytes, one per storage. On a CPU-only
machine host and device are one memory, but the same path runs: a new host buffer, the original
storage released, then regrown. Only ``device="cpu"`` is accepted (DeepSpeed refuses nvme here
too). Deliberate difference: DeepSpeed skips a state that is already offloaded and lets a reload
without an offload pass silently; both are errors here, since either means the caller lost track.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from deepshard.accelerators import get_accelerator
from deepshard.interface.errors import CommError, ConfigError

if TYPE_CHECKING:
    from deepshard.interface import FullGradientPath
    from deepshard.zero._flat_params import FlatParams
    from deepshard.zero._full_grad_store import SplitGradients
    from deepshard.zero._passes import BackwardPasses

__all__ = ["OFFLOAD_STATE_TYPES", "OffloadReport", "StateOffload", "normalize_include"]

OFFLOAD_STATE_TYPES = (
    "optim_states",
    "hp_params",
    "lp_params",
    "lp_grads",
    "contiguous_grad_buffer",
)
"""The state types ``offload_states`` moves (DeepSpeed's ``OffloadStateTypeEnum`` values)."""


@dataclass(frozen=True)
class OffloadReport:
    """What one `StateOffload.offload_states` or `StateOffload.reload_states` call moved.

    Attributes:
        states: The state types moved, in `OFFLOAD_STATE_TYPES` order.
        nbytes: Bytes copied (each storage once, however many state types share it).
        device_bytes_freed: How far the accelerator allocator's allocated bytes fell (negative on
            reload: they grew); ``None`` where the accelerator keeps no allocator statistics (CPU).
    """

    states: tuple[str, ...]
    nbytes: int
    device_bytes_freed: int | None


@dataclass(frozen=True)
class _Released:
    """One device storage emptied by an offload, and the host bytes that hold its contents."""

    storage: torch.UntypedStorage
    host: torch.Tensor


def normalize_include(include: Iterable[str] | str | None) -> tuple[str, ...]:
    """The state types an ``include`` argument names, in `OFFLOAD_STATE_TYPES` order.

    Args:
        include: State type names (DeepSpeed's ``OffloadStateTypeEnum`` members are strings too),
            one name, or ``None`` for all of them.

    Raises:
        ConfigError: A name is not a state type (the message lists the valid ones).
    """
    if include is None:
        return OFFLOAD_STATE_TYPES
    names = (
        [include] if isinstance(include, str) else [str(getattr(n, "value", n)) for n in include]
    )
    unknown = sorted(set(names) - set(OFFLOAD_STATE_TYPES))
    if unknown:
        raise ConfigError(
            f"offload_states(include=...) got unknown state types {unknown}; choose from "
            f"{list(OFFLOAD_STATE_TYPES)} (or pass include=None for all)"
        )
    return tuple(name for name in OFFLOAD_STATE_TYPES if name in names)


def _check_device(device: object) -> None:
    name = str(getattr(device, "value", device))
    if name != "cpu":
        raise ConfigError(
            f"offload_states(device={name!r}) is not supported; states move to host memory only: "
            "pass device='cpu' (DeepSpeed refuses nvme here too)"
        )


def _pageable(nbytes: int, *, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(nbytes, dtype=dtype)


def _copy_out(
    tensors: Iterable[torch.Tensor],
    released: dict[int, _Released],
    host: Callable[..., torch.Tensor],
    *,
    non_blocking: bool,
) -> list[_Released]:
    """Copy each storage of ``tensors`` not in ``released`` (by data pointer) to a new host
    buffer from ``host(nbytes, dtype=uint8)``; record it there and return the new records."""
    fresh = []
    for tensor in tensors:
        storage = tensor.untyped_storage()
        nbytes = storage.nbytes()
        if nbytes == 0 or storage.data_ptr() in released:
            continue  # empty (perhaps released by an earlier call), or already taken
        buffer = host(nbytes, dtype=torch.uint8)
        buffer.copy_(_bytes_of(storage, nbytes), non_blocking=non_blocking)
        record = _Released(storage, buffer)
        released[storage.data_ptr()] = record
        fresh.append(record)
    return fresh


def _bytes_of(storage: torch.UntypedStorage, nbytes: int) -> torch.Tensor:
    """A uint8 tensor over the first ``nbytes`` of ``storage``."""
    empty = torch.empty(0, dtype=torch.uint8, device=storage.device)
    return empty.set_(storage, 0, (nbytes,), (1,))


class StateOffload:
    """`ZeroOptimizer`'s ``offload_states`` / ``reload_states`` (a mixin: the optimizer sets the
    attributes below)."""

    inner: torch.optim.Optimizer
    _flat: list[FlatParams]
    _params: list[list[torch.nn.Parameter]]
    _masters: list[torch.Tensor]
    _store: SplitGradients
    _full: FullGradientPath
    _device: torch.device
    _passes: BackwardPasses
    _offloaded: dict[str, list[_Released]]
    """The state types offloaded now, each with the storages its offload released."""

    @property
    def offloaded_states(self) -> tuple[str, ...]:
        """The state types `offload_states` moved to the host and no reload brought back."""
        return tuple(name for name in OFFLOAD_STATE_TYPES if name in self._offloaded)

    def check_resident(self, what: str) -> None:
        """Refuse ``what`` while any state is offloaded (it would touch released memory).

        Raises:
            CommError: Some state is offloaded; the message says to call ``reload_states()``.
        """
        if self._offloaded:
            raise CommError(
                f"{what} was called while the states {list(self.offloaded_states)} are offloaded "
                "to the host; call reload_states() first"
            )

    def _in_backward(self) -> bool:
        return self._passes.in_pass

    def _state_tensors(self, name: str) -> list[torch.Tensor]:
        if name == "optim_states":
            inner = [v for s in self.inner.state.values() for v in s.values()]
            tensors = [t for t in inner if isinstance(t, torch.Tensor)]
            return tensors + self._full.tensors()
        if name == "hp_params":
            return list(self._masters)
        if name == "lp_params":
            return [flat.buffer for flat in self._flat]
        return self._store.state_tensors()[name]

    def offload_states(
        self,
        include: Iterable[str] | str | None = None,
        device: object = "cpu",
        pin_memory: bool = True,
        non_blocking: bool = False,
    ) -> OffloadReport:
        """Copy the selected states to host buffers and release their device memory.

        Until `reload_states`, ``step``, backward passes, ``zero_grad``, ``state_dict`` and
        ``load_state_dict`` are refused, and the model's parameters are empty when ``lp_params``
        (or a master that is the parameter buffer) is offloaded.

        Args:
            include: State types (`OFFLOAD_STATE_TYPES`); ``None`` offloads all of them.
            device: Where to: only ``"cpu"``.
            pin_memory: Allocate the host buffers page-locked (where the accelerator can).
            non_blocking: Do not wait for the device-to-host copies (device memory is freed in
                stream order, so later work cannot overwrite what is still being copied).

        Returns:
            What moved, and the allocator's drop where the accelerator reports it.

        Raises:
            ConfigError: An unknown state type or a device other than ``"cpu"``.
            CommError: A selected state is already offloaded, or a backward pass is running.
        """
        names = normalize_include(include)
        _check_device(device)
        again = [name for name in names if name in self._offloaded]
        if again:
            raise CommError(
                f"offload_states: {again} are already offloaded; call reload_states() before "
                "offloading them again"
            )
        if self._in_backward():
            raise CommError("offload_states() was called during a backward pass; call it after")
        accelerator = get_accelerator(self._device.type)
        before = accelerator.memory_allocated()
        released: dict[int, _Released] = {}  # by data pointer: shared storages move once
        host = accelerator.pin_empty if pin_memory else _pageable
        taken = {
            name: _copy_out(self._state_tensors(name), released, host, non_blocking=non_blocking)
            for name in names
        }
        if not all(record.storage.resizable() for record in released.values()):
            raise CommError(
                "offload_states: a state tensor's memory is not owned by torch (from_numpy or "
                "from_blob), so it cannot be released; nothing was offloaded"
            )
        self._point_params_at_empty(released)
        for record in released.values():
            record.storage.resize_(0)
        self._offloaded.update(taken)
        moved = sum(record.host.numel() for record in released.values())
        return OffloadReport(names, moved, _delta(before, accelerator.memory_allocated()))

    def reload_states(self, non_blocking: bool = False) -> OffloadReport:
        """Copy every offloaded state back into its original tensors (views stay valid).

        Args:
            non_blocking: Issue the host-to-device copies asynchronously; the call still waits
                for them before it lets the host buffers go.

        Returns:
            What moved back (``device_bytes_freed`` is then negative where reported).

        Raises:
            CommError: Nothing is offloaded.
        """
        if not self._offloaded:
            raise CommError(
                "reload_states() was called but no state is offloaded; call offload_states() "
                "first (or drop the reload)"
            )
        accelerator = get_accelerator(self._device.type)
        before = accelerator.memory_allocated()
        names = self.offloaded_states
        moved = 0
        for name in names:
            for record in self._offloaded[name]:
                nbytes = record.host.numel()
                record.storage.resize_(nbytes)
                _bytes_of(record.storage, nbytes).copy_(record.host, non_blocking=non_blocking)
                moved += nbytes
        if non_blocking:
            accelerator.synchronize(self._device)
        self._offloaded = {}
        self._point_params_at_buffers()
        return OffloadReport(names, moved, _delta(before, accelerator.memory_allocated()))

    def _point_params_at_empty(self, released: dict[int, _Released]) -> None:
        """Parameters viewing a buffer about to be released get empty ``.data`` meanwhile."""
        for flat, params in zip(self._flat, self._params, strict=True):
            if flat.buffer.untyped_storage().data_ptr() in released:
                for param in params:
                    param.data = torch.empty(0, dtype=param.dtype, device=param.device)

    def _point_params_at_buffers(self) -> None:
        with torch.no_grad():
            for flat, params in zip(self._flat, self._params, strict=True):
                for param, slot in zip(params, flat.layout.slots, strict=True):
                    if tuple(param.shape) != slot.shape:
                        param.data = flat.buffer[slot.offset : slot.stop].view(slot.shape)


def _delta(before: int | None, after: int | None) -> int | None:
    return None if before is None or after is None else before - after
