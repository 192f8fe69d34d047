"""Whole-matrix gradient transforms (Muon) at ZeRO stage 3.

Stage 3 reduce-scatters every unit's gradient at every backward pass, so at the step each rank
holds only its chunk of the accumulated, reduced gradient of each unit. Newton–Schulz needs a
matrix's *whole* reduced gradient, once per optimizer step. So at the step, before the norm,
every unit holding a transformed parameter all-gathers its gradient partitions into the unit's
full flat gradient (one all-gather per such unit, the same bytes the all-reduce of stages 0-2
moves beyond the reduce-scatter; units without one move nothing). Each rank that holds a piece
of a transformed matrix runs the transform on the matrix's full gradient, unscaled, with the
matrix's persistent buffer (Muon's momentum), and writes its piece of the update into its
gradient partition; the inner optimizer then applies what is element-wise (for Muon's
``use_muon`` views, decoupled weight decay and the learning rate: a 1-D view's gradient is the
finished update). The transform is `deepshard.zero.FullGradTransform`, as at stages 0-2.

Every rank computes the same update from the same gathered gradient, so the pieces agree.
Buffers are kept only for matrices the rank holds a piece of (about ``1/W`` of them, plus the
matrices straddling a chunk boundary), saved in ``state_dict`` by parameter name. The overflow
check runs before the gather (`deepshard.zero._step.checked_norm`), so a skipped step leaves
the momentum untouched. `Stage3FullGrads` is stage 3's `deepshard.interface.FullGradientPath`;
the buffers are `deepshard.zero._full_grads.TransformBuffers`, as at stages 0-2.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from deepshard.comm import CommsLogger, all_gather_into_tensor
from deepshard.zero._full_grads import (
    BufferAccess,
    FullGradTransform,
    TransformBuffers,
    selected_groups,
)
from deepshard.zero._sharded import ShardedModule

__all__ = ["Stage3FullGrads"]


@dataclass(frozen=True)
class _Target:
    """A transformed parameter with a piece on this rank."""

    name: str
    unit: int
    group_index: int
    shape: tuple[int, ...]
    offset: int
    """Where the parameter starts in its unit's flat layout."""
    flat_start: int
    flat_stop: int
    local_offset: int

    @property
    def numel(self) -> int:
        return int(torch.Size(self.shape).numel())


class Stage3FullGrads(BufferAccess):
    """The transformed matrices of one `Stage3Optimizer` on one rank.

    Args:
        transform: The full-gradient transform; ``None`` transforms nothing.
        selected: The parameters to transform (whole param groups of the inner optimizer).
        sharded: The model side.
        param_groups: The inner optimizer's param groups, before ZeRO re-points them.
        logger: Records the gradient all-gathers.

    Raises:
        ConfigError: As `deepshard.zero._full_grads.selected_groups`, or a selected parameter
            not in the sharded module.
    """

    def __init__(
        self,
        transform: FullGradTransform | None,
        selected: Iterable[torch.Tensor],
        sharded: ShardedModule,
        param_groups: Sequence[Mapping[str, Any]],
        logger: CommsLogger | None,
    ) -> None:
        params = [[p for p in g["params"] if p.requires_grad] for g in param_groups]
        flags = selected_groups(params, selected, has_transform=transform is not None)
        self._sharded, self._logger = sharded, logger
        self.groups = tuple(g for g, flag in enumerate(flags) if flag)
        """Indices of the inner optimizer's param groups this path owns."""
        chosen = [(g, p) for g, group in enumerate(params) if flags[g] for p in group]
        self._targets: list[_Target] = []
        units: set[int] = set()
        for g, param in chosen:
            info = sharded.shard_info(param)
            units.add(info.unit)  # every rank gathers the unit, holding a piece or not
            if info.local_numel:
                plan = sharded.plans[info.unit]
                slot = next(i for i, p in enumerate(plan.params) if p is param)
                offset = plan.layout.slots[slot].offset
                self._targets.append(
                    _Target(info.name, info.unit, g, info.shape, offset, info.flat_start,
                            info.flat_stop, info.local_offset)
                )  # fmt: skip
        self.units = tuple(sorted(units))
        """Units whose gradients are gathered at each step (the same on every rank)."""
        shapes = {t.name: t.shape for t in self._targets}
        hint = "load it into the same model, optimizer and world size (stage 3)"
        self._buffers = TransformBuffers(transform, shapes, hint)

    @property
    def active(self) -> bool:
        """Whether any parameter is transformed."""
        return bool(self.units)

    def apply(
        self, grads: Sequence[torch.Tensor], loss_scale: float, param_groups: Sequence[Any]
    ) -> None:
        """Replace every transformed piece of ``grads`` by the transform's update.

        The pieces stay loss-scaled (the update is multiplied back), so unscaling, the norm and
        clipping treat them like every other gradient afterwards.

        Args:
            grads: This rank's fp32 gradients, one per unit, laid out like its partition (the
                trainable prefix at least); changed in place.
            loss_scale: The factor the loss was multiplied by.
            param_groups: The inner optimizer's param groups (their ``momentum``...).

        Raises:
            ConfigError: The transform returned a tensor of another shape.
        """
        for unit in self.units:
            full = self._gather(unit)
            for t in (t for t in self._targets if t.unit == unit):
                grad = full[t.offset : t.offset + t.numel].view(t.shape)
                group = param_groups[t.group_index]
                update = self._buffers.update(t.name, grad, loss_scale, group)
                dest = grads[unit][t.local_offset : t.local_offset + t.flat_stop - t.flat_start]
                self._buffers.write(dest, update, (t.flat_start, t.flat_stop), loss_scale)

    def _gather(self, unit: int) -> torch.Tensor:
        """The unit's whole reduced gradient, flat, in the accumulation dtype."""
        state = self._sharded.units[unit]
        partition = state.grad_partition
        if partition is None:  # never reduced (no pass since the step): zeros, on every rank
            numel = state.plan.layout.partition_numel  # the partition may be in a file
            partition = torch.zeros(numel, dtype=state.plan.dtype, device=state.buffer.device)
        handle = all_gather_into_tensor(
            partition.contiguous(),
            group=self._sharded.group,
            logger=self._logger,
            log_name="zero3_all_gather_muon_grads",
        )
        return handle.wait()

    def full_shape(self, param: object) -> tuple[int, ...] | None:
        """Stage 3's masters are flat views whose gradient is the finished update: ``None``."""
        return None
