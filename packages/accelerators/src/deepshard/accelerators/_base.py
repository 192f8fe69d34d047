"""What every accelerator shares: identity, host-memory allocation and version reporting.

Page-locked ("pinned") host memory lets the device copy to and from the host asynchronously. It
only exists next to a device: the driver of that device locks the pages. So pinning is a property
of the accelerator, not of the tensor, and each subclass says through `_pins_host_memory`
whether it can. Where it cannot (the CPU accelerator), the ``pin_*`` methods return ordinary host
memory, so code written for a GPU runs unchanged on a CPU-only machine.
"""

from __future__ import annotations

import abc

import torch

from deepshard.accelerators._errors import AcceleratorError
from deepshard.accelerators._info import torch_info

__all__ = ["AcceleratorBase"]


def _shape(size: tuple[object, ...]) -> tuple[int, ...]:
    """Normalise ``pin_empty``'s ``*size``, given as ints or as one tuple/list/``torch.Size``."""
    dims = tuple(size[0]) if len(size) == 1 and isinstance(size[0], (tuple, list)) else size
    shape: list[int] = []
    for dim in dims:
        if isinstance(dim, bool) or not isinstance(dim, int) or dim < 0:
            raise AcceleratorError(
                f"pin_empty size must be non-negative ints, got {dims!r}; "
                "pass it as pin_empty(2, 3) or pin_empty((2, 3))."
            )
        shape.append(dim)
    return tuple(shape)


def _require_host_tensor(tensor: torch.Tensor, method: str) -> None:
    """Raise unless ``tensor`` is a dense tensor in host (CPU) memory."""
    if tensor.device.type != "cpu":
        raise AcceleratorError(
            f"{method} needs a CPU tensor, got one on {tensor.device}; "
            "copy it to the host first with tensor.cpu()."
        )
    if tensor.layout != torch.strided:
        raise AcceleratorError(
            f"{method} needs a dense (strided) tensor, got layout {tensor.layout}; "
            "call tensor.to_dense() first."
        )


class AcceleratorBase(abc.ABC):
    """Base of the concrete accelerators: stateless, so instances of one kind compare equal."""

    @property
    @abc.abstractmethod
    def name(self) -> str:
        """The torch device type this accelerator drives."""

    @property
    @abc.abstractmethod
    def communication_backend(self) -> str:
        """The ``torch.distributed`` backend for tensors on this device."""

    @abc.abstractmethod
    def _pins_host_memory(self) -> bool:
        """Whether host memory can be page-locked for this device."""

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self)

    def __hash__(self) -> int:
        return hash(type(self))

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

    def pin_memory(self, tensor: torch.Tensor) -> torch.Tensor:
        """Return ``tensor`` in page-locked host memory, copying only if it is not pinned yet.

        Where the accelerator cannot pin (the CPU), ``tensor`` itself is returned.

        Args:
            tensor: A dense CPU tensor.

        Raises:
            AcceleratorError: ``tensor`` is not a dense CPU tensor.
        """
        _require_host_tensor(tensor, "pin_memory")
        if not self._pins_host_memory() or tensor.is_pinned():
            return tensor
        return tensor.pin_memory()

    def pin_empty(
        self, *size: int | tuple[int, ...] | torch.Size, dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        """Allocate an uninitialised contiguous host tensor, page-locked where possible.

        The memory is allocated pinned directly (no pageable tensor is made and then copied).

        Args:
            *size: The shape, as ints (``pin_empty(2, 3)``) or one sequence (``pin_empty((2, 3))``).
            dtype: Element type; ``torch.get_default_dtype()`` when ``None``.

        Raises:
            AcceleratorError: A dimension is negative or not an int.
        """
        shape = _shape(size)
        return torch.empty(shape, dtype=dtype, device="cpu", pin_memory=self._pins_host_memory())

    def pin_empty_like(self, tensor: torch.Tensor) -> torch.Tensor:
        """`pin_empty` with the shape and dtype of ``tensor`` (the result is contiguous).

        Args:
            tensor: A dense CPU tensor.

        Raises:
            AcceleratorError: ``tensor`` is not a dense CPU tensor.
        """
        _require_host_tensor(tensor, "pin_empty_like")
        return self.pin_empty(*tensor.shape, dtype=tensor.dtype)

    def torch_info(self) -> dict[str, str | None]:
        """Versions of torch, CUDA, HIP and NCCL; ``None`` for a part this build lacks."""
        return torch_info()

    # --- DeepSpeed's accelerator names, so scripts written for it run unchanged ---------------

    @abc.abstractmethod
    def current_device(self) -> torch.device:
        """The device this process computes on."""

    @abc.abstractmethod
    def device(self, index: int | None = None) -> torch.device:
        """The device with ``index``, or the current one."""

    def device_name(self, device_index: int | None = None) -> str:
        """DeepSpeed's device string: the type (``"cuda"``) or, with an index, ``"cuda:1"``.

        Raises:
            AcceleratorError: ``device_index`` does not name a visible device.
        """
        return self.name if device_index is None else str(self.device(device_index))

    def current_device_name(self) -> str:
        """The current device as a string (``"cuda:0"``, ``"cpu"``), as DeepSpeed names it."""
        return str(self.current_device())

    def communication_backend_name(self) -> str:
        """DeepSpeed's name for `communication_backend`."""
        return self.communication_backend

    def is_available(self) -> bool:
        """Whether this accelerator's devices can be used in this process."""
        return True

    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` lives on this accelerator's kind of device."""
        return tensor.device.type == self.name
