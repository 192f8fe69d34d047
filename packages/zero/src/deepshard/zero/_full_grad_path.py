"""Stages 0-2's full-gradient path (`deepshard.interface.FullGradientPath`): Muon under ZeRO 0-2.

`FullGroupsPath` owns the param groups under the full-gradient transform (see
`deepshard.zero._full_grads` for the contract): their gradients go to a store of their own
(`deepshard.zero._full_grad_store.FullGroupGradients`), which all-reduces their buckets whole
once per accumulation cycle; at the step it runs the transform on each parameter this rank holds
a piece of and writes the piece of the update into this rank's gradient partition. The inner
optimizer steps one 1-D view of the master per such piece, so `full_shape` can give each view
its parameter's real shape; the ordinary groups keep flat masters cut into bounded views.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from deepshard.zero._flat_params import master_views
from deepshard.zero._full_grad_store import FullGroupGradients, local_settings
from deepshard.zero._full_grads import (
    BufferAccess,
    FullGradTransform,
    TransformBuffers,
    selected_groups,
)
from deepshard.zero._gradients import StoreSettings
from deepshard.zero._shards import ParamShard
from deepshard.zero.layout import FlatLayout, ParamSlot

__all__ = ["FullGroupsPath", "StoreChoice"]


@dataclass(frozen=True)
class StoreChoice:
    """How the full groups' gradient store is built.

    Attributes:
        settings: The optimizer's store settings (positions of every group).
        grad_dtypes: The gradients' dtype of every group.
        stage: The ZeRO stage (0-2).
        overlap: ``overlap_comm`` (read at stage 2).
    """

    settings: StoreSettings
    grad_dtypes: tuple[torch.dtype, ...]
    stage: int
    overlap: bool


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


class FullGroupsPath(BufferAccess):
    """The full groups of one `ZeroOptimizer` on one rank: their store, views and buffers.

    Args:
        transform: The full-gradient transform (``None``: nothing is transformed).
        flags: Per group, whether it is transformed (`selected_groups`).
        layouts: Every group's layout.
        masters: Every group's fp32 master partition on this rank.
        names: Every group's parameter names, in layout order.
        rank: This rank's partition index (0 when unpartitioned).
        view_numel: Most elements of a view of an ordinary group's master (`master_views`);
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
        self.flags = tuple(flags)
        self._layouts = tuple(layouts)
        self._targets = [
            _Target(names[g][slot.index], g, slot, piece.flat_start, piece.flat_stop,
                    piece.local_offset)
            for g, layout in enumerate(layouts) if self.flags[g]
            for slot in layout.slots
            for piece in layout.pieces(slot) if piece.rank == rank
        ]  # fmt: skip
        shapes = {t.name: t.slot.shape for t in self._targets}
        hint = "load it into the same model, optimizer and data-parallel layout"
        self._buffers = TransformBuffers(transform, shapes, hint)
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
        self._local = {g: i for i, g in enumerate(self.groups)}
        self.store: FullGroupGradients | None = None
        """The full groups' gradient store (`build_store`); ``None`` without full groups."""

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
        store: StoreChoice,
        view_numel: int | None = None,
    ) -> FullGroupsPath:
        """Select the groups, build their store, point the inner optimizer's groups at views.

        Args:
            transform: The transform, or ``None``.
            selected: ``transformed_params``.
            params: Each group's trainable parameters.
            layouts: Their layouts.
            shards: Every trainable parameter's shard (its name and layout), group by group.
            masters: Every group's master partition on this rank.
            rank: This rank's partition index.
            param_groups: The inner optimizer's param groups, changed in place.
            store: How to build the full groups' store.
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
        full.build_store(store)
        return full

    def build_store(self, choice: StoreChoice) -> None:
        """Create the full groups' gradient store (nothing without full groups)."""
        if not self.groups:
            return
        self.store = FullGroupGradients(
            [self._layouts[g] for g in self.groups],
            [choice.grad_dtypes[g] for g in self.groups],
            local_settings(choice.settings, self.groups),
            stage=choice.stage,
            overlap=choice.overlap,
        )

    @property
    def groups(self) -> tuple[int, ...]:
        """Indices of the param groups this path owns."""
        return tuple(g for g, flag in enumerate(self.flags) if flag)

    @property
    def active(self) -> bool:
        """Whether any group is transformed."""
        return any(self.flags)

    def inner_params(self, group_index: int) -> list[torch.Tensor]:
        """What the inner optimizer's param group ``group_index`` holds (no empty tensor)."""
        return [view for view, lo, hi in self.views[group_index] if hi > lo]

    def full_shape(self, param: object) -> tuple[int, ...] | None:
        """The parameter's shape for a view of a transformed group, else ``None``."""
        return self._shapes.get(id(param))

    def apply(
        self, grads: Sequence[torch.Tensor], loss_scale: float, param_groups: Sequence[Any]
    ) -> None:
        """Replace every transformed piece of ``grads`` by the transform's update.

        Args:
            grads: This rank's fp32 gradient partitions of every group, changed in place.
            loss_scale: The factor the loss was multiplied by (the pieces stay scaled by it).
            param_groups: The inner optimizer's param groups.

        Raises:
            ConfigError: The transform returned a tensor of another shape.
        """
        for t in self._targets:
            assert self.store is not None, "targets exist only with full groups"
            grad = self.store.full_gradient(self._local[t.group_index], t.slot)
            group: Mapping[str, Any] = param_groups[t.group_index]
            update = self._buffers.update(t.name, grad, loss_scale, group)
            dest = grads[t.group_index][t.local_offset : t.local_stop]
            self._buffers.write(dest, update, (t.flat_start, t.flat_stop), loss_scale)
