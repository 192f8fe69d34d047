"""Stages 0-2's full-gradient path (`deepshard.interface.FullGradientPath`): Muon under ZeRO 0-2.

`FullGroupsPath` owns the units holding parameters under the full-gradient transform (see
`deepshard.zero._full_grads` for the contract; the transformed parameters make up whole param
groups, such as Muon's ``use_muon`` groups): those units' gradients go to a store of their own
(`deepshard.zero._full_grad_store.FullGroupGradients`), which all-reduces their buckets whole
once per accumulation cycle; at the step it runs the transform on each transformed parameter
this rank holds a piece of and writes the piece of the update into this rank's gradient
partition (the unit's other parameters keep their pieces of the reduced gradient). The inner
optimizer steps one 1-D view of the master per transformed piece, so `full_shape` can give each
view its parameter's real shape; everything else is stepped in bounded flat views
(`deepshard.zero._master_views`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from deepshard.zero._full_grad_store import FullGroupGradients, local_settings
from deepshard.zero._full_grads import (
    BufferAccess,
    FullGradTransform,
    TransformBuffers,
    selected_groups,
)
from deepshard.zero._gradients import StoreSettings
from deepshard.zero._master_views import ViewPlan, plan_master_views
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
    """Its unit (the layout it lives in)."""
    param_group: int
    """The inner optimizer's param group whose settings the transform reads."""
    slot: ParamSlot
    flat_start: int
    flat_stop: int
    local_offset: int

    @property
    def local_stop(self) -> int:
        return self.local_offset + self.flat_stop - self.flat_start


class FullGroupsPath(BufferAccess):
    """The full units of one `ZeroOptimizer` on one rank: their store, views and buffers.

    A *full unit* holds at least one transformed parameter; its gradient is all-reduced whole
    (its other parameters then read their pieces of that), and each transformed piece's
    gradient is replaced by its parameter's update at the step.

    Args:
        transform: The full-gradient transform (``None``: nothing is transformed).
        targets: The transformed pieces this rank holds.
        flags: Per unit, whether it is a full unit.
        layouts: Every unit's layout.
        masters: Every unit's fp32 master partition on this rank.
        plans: Every master view of this rank (`deepshard.zero._master_views`).
    """

    def __init__(
        self,
        transform: FullGradTransform | None,
        targets: Sequence[_Target],
        flags: Sequence[bool],
        layouts: Sequence[FlatLayout],
        masters: Sequence[torch.Tensor],
        plans: Sequence[ViewPlan],
    ) -> None:
        self.flags = tuple(flags)
        self._layouts = tuple(layouts)
        self._targets = list(targets)
        shapes = {t.name: t.slot.shape for t in self._targets}
        hint = "load it into the same model, optimizer and data-parallel layout"
        self._buffers = TransformBuffers(transform, shapes, hint)
        self.views: list[list[tuple[torch.Tensor, int, int]]] = [[] for _ in masters]
        """Per unit, the tensors the inner optimizer steps and their range of the partition."""
        self._groups: list[list[torch.Tensor]] = []
        self._shapes: dict[int, tuple[int, ...]] = {}
        for plan in plans:
            master = masters[plan.unit]
            whole = plan.lo == 0 and plan.hi == master.numel() and plan.shape is None
            view = master if whole else master[plan.lo : plan.hi]
            if plan.shape is not None:
                self._shapes[id(view)] = plan.shape
            self.views[plan.unit].append((view, plan.lo, plan.hi))
            while len(self._groups) <= plan.group:
                self._groups.append([])
            if plan.hi > plan.lo:
                self._groups[plan.group].append(view)
        self._local = {g: i for i, g in enumerate(self.groups)}
        self.store: FullGroupGradients | None = None
        """The full units' gradient store (`build_store`); ``None`` without full units."""

    @classmethod
    def build(
        cls,
        transform: FullGradTransform | None,
        selected: Iterable[torch.Tensor],
        *,
        params: Sequence[Sequence[torch.Tensor]],
        layouts: Sequence[FlatLayout],
        names: Sequence[Sequence[str]],
        masters: Sequence[torch.Tensor],
        rank: int,
        param_groups: Sequence[MutableMapping[str, Any]],
        store: StoreChoice,
        view_numel: int | None = None,
    ) -> FullGroupsPath:
        """Select the units, build their store, point the inner optimizer's groups at views.

        Args:
            transform: The transform, or ``None``.
            selected: ``transformed_params``.
            params: Each unit's trainable parameters.
            layouts: Their layouts.
            names: Each unit's parameter names, in layout order.
            masters: Every unit's master partition on this rank.
            rank: This rank's partition index.
            param_groups: The inner optimizer's param groups, changed in place.
            store: How to build the full units' store.
            view_numel: Most elements of an ordinary master view; ``None``: unbounded.

        Raises:
            ConfigError: As `selected_groups` (on the inner optimizer's param groups), or a
                param group holding a parameter no unit owns.
        """
        trainable = [[p for p in g["params"] if p.requires_grad] for g in param_groups]
        flags = selected_groups(trainable, selected, has_transform=transform is not None)
        chosen = {id(p) for g, flag in zip(trainable, flags, strict=True) if flag for p in g}
        group_of = {id(p): g for g, ps in enumerate(trainable) for p in ps}
        plans = plan_master_views(params, layouts, rank, param_groups, chosen, view_numel)
        targets = [
            _Target(names[u][slot.index], u, group_of[id(param)], slot, piece.flat_start,
                    piece.flat_stop, piece.local_offset)
            for u, layout in enumerate(layouts)
            for param, slot in zip(params[u], layout.slots, strict=True) if id(param) in chosen
            for piece in layout.pieces(slot) if piece.rank == rank
        ]  # fmt: skip
        unit_flags = [any(id(p) in chosen for p in ps) for ps in params]
        full = cls(transform, targets, unit_flags, layouts, masters, plans)
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
        """Indices of the units this path owns."""
        return tuple(g for g, flag in enumerate(self.flags) if flag)

    @property
    def active(self) -> bool:
        """Whether any group is transformed."""
        return any(self.flags)

    def inner_params(self, group_index: int) -> list[torch.Tensor]:
        """What the inner optimizer's param group ``group_index`` holds (no empty tensor)."""
        return list(self._groups[group_index]) if group_index < len(self._groups) else []

    def full_shape(self, param: object) -> tuple[int, ...] | None:
        """The parameter's shape for a view of a transformed group, else ``None``."""
        return self._shapes.get(id(param))

    def apply(
        self, grads: Sequence[torch.Tensor], loss_scale: float, param_groups: Sequence[Any]
    ) -> None:
        """Replace every transformed piece of ``grads`` by the transform's update.

        Args:
            grads: This rank's fp32 gradient partitions of every unit, changed in place.
            loss_scale: The factor the loss was multiplied by (the pieces stay scaled by it).
            param_groups: The inner optimizer's param groups.

        Raises:
            ConfigError: The transform returned a tensor of another shape.
        """
        for t in self._targets:
            assert self.store is not None, "targets exist only with full groups"
            grad = self.store.full_gradient(self._local[t.group_index], t.slot)
            group: Mapping[str, Any] = param_groups[t.param_group]
            update = self._buffers.update(t.name, grad, loss_scale, group)
            dest = grads[t.group_index][t.local_offset : t.local_stop]
            self._buffers.write(dest, update, (t.flat_start, t.flat_stop), loss_scale)
