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
transformed parameters or none. Their buckets are all-reduced whole (never reduce-scattered),
once per accumulation cycle, at the boundary: stages 0 and 1 keep a full gradient buffer anyway;
stage 2 keeps one for these groups too and accumulates micro-steps into it locally instead of
reduce-scattering every micro-step. The transform runs in ``step`` on every rank that holds a
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

from collections.abc import Callable, Iterable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias

import torch

from deepshard.interface.errors import CheckpointError, ConfigError
from deepshard.zero._flat_params import master_views
from deepshard.zero._shards import ParamShard
from deepshard.zero.layout import FlatLayout, ParamSlot

__all__ = ["FullGradTransform", "FullGradTransforms", "selected_groups"]

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


@dataclass(frozen=True)
class _Target:
    """A transformed parameter with a piece on this rank, and where the piece goes."""

    name: str
    group_index: int
    slot: ParamSlot
    flat_start: int
    flat_stop: int
    local_offset: int

    @property
    def local_stop(self) -> int:
        return self.local_offset + self.flat_stop - self.flat_start


class FullGradTransforms:
    """The transformed groups of one `ZeroOptimizer` on one rank: views, buffers, the transform.

    Args:
        transform: The full-gradient transform (``None``: nothing is transformed).
        flags: Per group, whether it is transformed (`selected_groups`).
        layouts: Every group's layout.
        masters: Every group's fp32 master partition on this rank.
        names: Every group's parameter names, in layout order.
        rank: This rank's partition index (0 when unpartitioned).
        view_numel: Most elements of a view of an untransformed group's master (`master_views`);
            ``None`` steps each such master whole.
    """

    def __init__(
        self,
        transform: FullGradTransform | None,
        flags: Sequence[bool],
        layouts: Sequence[FlatLayout],
        masters: Sequence[torch.Tensor],
        names: Sequence[Sequence[str]],
        rank: int,
        view_numel: int | None = None,
    ) -> None:
        assert transform is not None or not any(flags), "selected groups need a transform"
        self._transform = transform
        self.flags = tuple(flags)
        self._targets = [
            _Target(names[g][slot.index], g, slot, piece.flat_start, piece.flat_stop,
                    piece.local_offset)
            for g, layout in enumerate(layouts) if self.flags[g]
            for slot in layout.slots
            for piece in layout.pieces(slot) if piece.rank == rank
        ]  # fmt: skip
        self.views: list[list[tuple[torch.Tensor, int, int]]] = []
        """Per group, the tensors the inner optimizer steps and their range of the partition."""
        self._shapes: dict[int, tuple[int, ...]] = {}
        for g, master in enumerate(masters):
            if not self.flags[g]:
                self.views.append(master_views(master, view_numel))
                continue
            group_views = []
            for t in (t for t in self._targets if t.group_index == g):
                view = master[t.local_offset : t.local_stop]
                self._shapes[id(view)] = t.slot.shape
                group_views.append((view, t.local_offset, t.local_stop))
            self.views.append(group_views)
        self.buffers: dict[str, torch.Tensor] = {}
        """The transform's persistent buffer of every target, by parameter name."""

    @classmethod
    def build(
        cls,
        transform: FullGradTransform | None,
        selected: Iterable[torch.Tensor],
        *,
        params: Sequence[Sequence[torch.Tensor]],
        layouts: Sequence[FlatLayout],
        shards: Sequence[ParamShard],
        masters: Sequence[torch.Tensor],
        rank: int,
        param_groups: Sequence[MutableMapping[str, Any]],
        view_numel: int | None = None,
    ) -> FullGradTransforms:
        """Select the groups, and point the inner optimizer's transformed groups at the views.

        Args:
            transform: The transform, or ``None``.
            selected: ``transformed_params``.
            params: Each group's trainable parameters.
            layouts: Their layouts.
            shards: Every trainable parameter's shard (its name and layout), group by group.
            masters: Every group's master partition on this rank.
            rank: This rank's partition index.
            param_groups: The inner optimizer's param groups, changed in place.
            view_numel: As for the constructor.

        Raises:
            ConfigError: As `selected_groups`.
        """
        flags = selected_groups(params, selected, has_transform=transform is not None)
        names: list[list[str]] = [[] for _ in params]
        for shard in shards:
            names[shard.group_index].append(shard.name)
        full = cls(transform, flags, layouts, masters, names, rank, view_numel)
        for g, param_group in enumerate(param_groups):
            param_group["params"] = full.inner_params(g)
        return full

    def inner_params(self, group_index: int) -> list[torch.Tensor]:
        """What the inner optimizer's param group ``group_index`` holds (no empty tensor)."""
        return [view for view, lo, hi in self.views[group_index] if hi > lo]

    def full_shape(self, param: object) -> tuple[int, ...] | None:
        """The parameter's shape for a view of a transformed group, else ``None``."""
        return self._shapes.get(id(param))

    def apply(
        self,
        full_gradient: Callable[[int, ParamSlot], torch.Tensor],
        grads: Sequence[torch.Tensor],
        loss_scale: float,
        param_groups: Sequence[Mapping[str, Any]],
    ) -> None:
        """Replace every transformed piece of ``grads`` by the transform's update.

        The partitions stay loss-scaled (the update is multiplied back), so unscaling,
        the norm and clipping treat them like every other gradient afterwards.

        Args:
            full_gradient: ``(group index, slot) ->`` the full reduced, loss-scaled gradient.
            grads: This rank's fp32 gradient partitions, changed in place.
            loss_scale: The factor the loss was multiplied by.
            param_groups: The inner optimizer's param groups.

        Raises:
            ConfigError: The transform returned a tensor of another shape.
        """
        transform = self._transform
        for t in self._targets:
            assert transform is not None, "targets exist only with a transform"
            grad = full_gradient(t.group_index, t.slot)
            if loss_scale != 1.0:
                grad = grad / loss_scale
            update = transform(grad, self._buffer(t.name, grad), param_groups[t.group_index])
            if tuple(update.shape) != t.slot.shape:
                raise ConfigError(
                    f"full_grad_transform returned shape {tuple(update.shape)} for parameter "
                    f"{t.name!r} of shape {t.slot.shape}; it must return the update in the "
                    "gradient's shape"
                )
            dest = grads[t.group_index][t.local_offset : t.local_stop]
            dest.copy_(update.reshape(-1)[t.flat_start : t.flat_stop])
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
        expected = {t.name: t.slot.shape for t in self._targets}
        for name, saved in state.items():
            if name not in expected or tuple(saved.shape) != expected[name]:
                raise CheckpointError(
                    f"ZeRO state dict has a full-gradient buffer for {name!r} of shape "
                    f"{tuple(saved.shape)}, which this rank does not transform (its transformed "
                    f"parameters: {sorted(expected)}); load it into the same model, optimizer "
                    "and data-parallel layout"
                )
        self.buffers = {name: saved.detach().clone() for name, saved in state.items()}
