"""Whole-parameter gradient transforms (Muon) on top of flat, element-wise ZeRO partitions.

ZeRO's partitions cut parameters at arbitrary element boundaries, which is harmless for an
element-wise optimizer but not for one whose update of a matrix depends on the whole matrix:
Muon orthogonalizes the (momentum-blended) gradient with Newton–Schulz. For such parameters ZeRO
takes a *full-gradient transform*, a plain callable::

    update = transform(grad, buffer, group)

* ``grad``: the parameter's full reduced gradient, in its own shape and in the gradient
  accumulation dtype, unscaled (divided by the loss scale), summed over every micro-step of the
  accumulation cycle. The transform must not keep it.
* ``buffer``: a persistent tensor shaped and typed like ``grad``, zero at first, which the
  transform may update in place (Muon's momentum). It follows the gradient's dtype (a buffer
  restored in another dtype is cast), is part of ``ZeroOptimizer.state_dict`` under the
  parameter's name, and is counted in ``optimizer_state_bytes``.
* ``group``: the inner optimizer's param group holding the parameter (``momentum``,
  ``ns_method``... as an LR or momentum schedule last left them).

The update replaces the gradient in this rank's partition; the inner optimizer then sees it as
the ``.grad`` of the master and applies what is element-wise: for Muon's ``use_muon`` groups,
decoupled weight decay and the learning rate.

**Selection is per param group.** A param group's trainable parameters are transformed all or
none (Muon's ``use_muon`` groups are exactly that), so a flat buffer and its buckets hold only
transformed parameters or none. Those groups form a *full-gradient path*
(`deepshard.interface.FullGradientPath`), the only thing the optimizer's step talks to:
at stages 0-2 `deepshard.zero._full_grad_path.FullGroupsPath`, whose own gradient store
(`deepshard.zero._full_grad_store.FullGroupGradients`) all-reduces their buckets whole (never
reduce-scattered), once per accumulation cycle, at the boundary, accumulating micro-steps
locally in a full gradient buffer (also at stage 2); the ordinary stores never see these
groups. At stage 3 it is `deepshard.zero._stage3_muon.Stage3FullGrads`. This module holds what
both share: the transform's type, the group selection and the persistent buffers. The transform
runs in ``step`` on every rank that holds a
piece of the parameter (every rank at stage 0; at stages 1-2 the owner, or the few owners of a
parameter straddling a chunk boundary, which compute the same update from the same all-reduced
gradient). Memory per rank, beyond plain ZeRO: the full gradient of these groups at stage 2, and
one full-size buffer for each transformed parameter with a piece on the rank (about ``1/W`` of
them, plus the straddlers; all of them at stage 0).

**How the inner optimizer recognises them** (`deepshard.interface.ParamShapes`). In a
transformed group the inner optimizer does not get one flat master per group but one 1-D view of
the master per parameter piece this rank holds, so every tensor it steps belongs to exactly one
parameter and ``full_shape`` can answer with that parameter's real shape: a Muon ``use_muon``
group accepts the views as matrices, and a view's gradient is the finished update. An ordinary
group's master (whole, or cut into bounded views, `deepshard.zero._flat_params.master_views`)
covers pieces of several parameters and has no single layer shape: ``full_shape`` returns
``None`` for it, so an optimizer treats it as 1-D, i.e. element-wise, which is how ZeRO steps it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, TypeAlias

import torch

from deepshard.interface.errors import CheckpointError, ConfigError

__all__ = ["BufferAccess", "FullGradTransform", "TransformBuffers", "selected_groups"]

FullGradTransform: TypeAlias = Callable[
    [torch.Tensor, torch.Tensor, Mapping[str, Any]], torch.Tensor
]
"""``(full reduced gradient, its persistent buffer, the param group) -> update`` (same shape)."""


def selected_groups(
    params: Sequence[Sequence[torch.Tensor]],
    transformed: Iterable[torch.Tensor],
    *,
    has_transform: bool,
) -> tuple[bool, ...]:
    """Which param groups are transformed, checking that selection covers whole groups.

    Args:
        params: Each group's trainable parameters.
        transformed: The parameters to transform (frozen ones are ignored).
        has_transform: Whether a transform was given.

    Returns:
        One flag per group.

    Raises:
        ConfigError: Parameters selected without a transform, a selected parameter in no
            group, or a group only partly selected.
    """
    chosen = {id(p) for p in transformed if p.requires_grad}
    if chosen and not has_transform:
        raise ConfigError(
            "transformed_params were given without a full_grad_transform; pass the transform "
            "(e.g. one calling deepshard.optimizers.muon_update) or drop transformed_params"
        )
    flags = []
    for g, group in enumerate(params):
        ids = [id(p) for p in group]
        hits = sum(i in chosen for i in ids)
        if 0 < hits < len(ids):
            raise ConfigError(
                f"param group {g} has {hits} of its {len(ids)} trainable parameters in "
                "transformed_params; ZeRO transforms whole param groups, so put the transformed "
                "parameters in a group of their own (as Muon's use_muon groups are)"
            )
        flags.append(hits > 0)
        chosen.difference_update(ids)
    if chosen:
        raise ConfigError(
            f"{len(chosen)} transformed_params are in none of the optimizer's param groups; "
            "select parameters the wrapped optimizer trains"
        )
    return tuple(flags)


class TransformBuffers:
    """The transform and its persistent buffers, by parameter name, on one rank.

    Args:
        transform: The full-gradient transform (``None`` only when nothing is transformed).
        shapes: The shape of every parameter this rank transforms, by name.
        checkpoint_hint: How to load a checkpoint these buffers accept (ends the error message
            of `load_state_dict`).
    """

    def __init__(
        self,
        transform: FullGradTransform | None,
        shapes: Mapping[str, tuple[int, ...]],
        checkpoint_hint: str,
    ) -> None:
        assert transform is not None or not shapes, "transformed parameters need a transform"
        self._transform = transform
        self._shapes = dict(shapes)
        self._hint = checkpoint_hint
        self.buffers: dict[str, torch.Tensor] = {}
        """The transform's persistent buffer of every parameter used so far."""

    def update(
        self, name: str, grad: torch.Tensor, loss_scale: float, group: Mapping[str, Any]
    ) -> torch.Tensor:
        """The transform's update of one parameter from its full, loss-scaled gradient.

        Raises:
            ConfigError: The transform returned a tensor of another shape.
        """
        assert self._transform is not None, "update is called only for transformed parameters"
        if loss_scale != 1.0:
            grad = grad / loss_scale
        update = self._transform(grad, self._buffer(name, grad), group)
        shape = self._shapes[name]
        if tuple(update.shape) != shape:
            raise ConfigError(
                f"full_grad_transform returned shape {tuple(update.shape)} for parameter "
                f"{name!r} of shape {shape}; it must return the update in the gradient's shape"
            )
        return update

    @staticmethod
    def write(
        dest: torch.Tensor, update: torch.Tensor, flat: tuple[int, int], loss_scale: float
    ) -> None:
        """Copy the elements ``flat`` of ``update`` into ``dest``, loss-scaled again."""
        dest.copy_(update.reshape(-1)[flat[0] : flat[1]])
        if loss_scale != 1.0:
            dest.mul_(loss_scale)

    def _buffer(self, name: str, grad: torch.Tensor) -> torch.Tensor:
        buffer = self.buffers.get(name)
        if buffer is None:
            buffer = torch.zeros_like(grad, memory_format=torch.contiguous_format)
        elif buffer.dtype != grad.dtype or buffer.device != grad.device:
            buffer = buffer.to(dtype=grad.dtype, device=grad.device)
        self.buffers[name] = buffer
        return buffer

    def tensors(self) -> list[torch.Tensor]:
        """The live buffers."""
        return list(self.buffers.values())

    def nbytes(self) -> int:
        """Bytes of the buffers on this rank."""
        return sum(b.numel() * b.element_size() for b in self.buffers.values())

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The buffers by parameter name (copies)."""
        return {name: buffer.detach().clone() for name, buffer in self.buffers.items()}

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        """Restore `state_dict`; buffers keep their saved dtype until the next use casts them.

        Raises:
            CheckpointError: A buffer for a parameter this rank does not transform, or of
                another shape.
        """
        for name, saved in state.items():
            if name not in self._shapes or tuple(saved.shape) != self._shapes[name]:
                raise CheckpointError(
                    f"ZeRO state dict has a full-gradient buffer (full_grad_buffers) for {name!r} "
                    f"of shape {tuple(saved.shape)}, which this rank does not transform (its "
                    f"transformed parameters: {sorted(self._shapes)}); {self._hint}"
                )
        self.buffers = {name: saved.detach().clone() for name, saved in state.items()}


class BufferAccess:
    """What a full-gradient path reports about its `TransformBuffers` (shared by the stage 0-2
    path and stage 3's, which both keep theirs as ``_buffers``)."""

    _buffers: TransformBuffers

    @property
    def buffers(self) -> dict[str, torch.Tensor]:
        """The transform's persistent buffer of every target used so far, by parameter name."""
        return self._buffers.buffers

    def tensors(self) -> list[torch.Tensor]:
        """The live buffers."""
        return self._buffers.tensors()

    @property
    def target_shapes(self) -> dict[str, tuple[int, ...]]:
        """The shape of every parameter this rank transforms, by name (a buffer exists once
        the parameter was first transformed, or was loaded)."""
        return dict(self._buffers._shapes)

    def nbytes(self) -> int:
        """Bytes of the buffers on this rank."""
        return self._buffers.nbytes()

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The buffers by parameter name (copies)."""
        return self._buffers.state_dict()

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        """Restore `state_dict` (see `TransformBuffers.load_state_dict`)."""
        self._buffers.load_state_dict(state)
