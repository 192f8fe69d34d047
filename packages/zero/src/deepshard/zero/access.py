"""Reading and writing one parameter's fp32 master, gradient and optimizer state under ZeRO.

DeepSpeed's ``safe_get_full_fp32_param(param)`` family finds the optimizer through attributes it
patches onto the parameter. DeepShard patches nothing and keeps no global registry, so each
function here takes the *owner* as well: the object that holds the parameter's partitions, a
`ZeroOptimizer` for stages 0-3 (``engine.safe_get_full_fp32_param(param)`` passes the engine's).

*Full* functions work on the whole tensor, in the parameter's (unpartitioned) shape: a getter
writes this rank's pieces, per the parameter's `deepshard.interface.ShardMap`, into a zero
tensor and sums it over the owner's group with one all-reduce (DeepSpeed's method; an expert
parameter's own ``dp`` group when the model has several reduction groups), so **every rank of
the group must call it, in the same order**; when every rank holds the whole parameter
(stage 0) there is nothing to gather and no collective. *Local* functions work on this rank's
elements of the parameter: its pieces of the shard map back to back, as a 1-D tensor (empty
where it holds none). Getters return fp32 copies; change values through the setters.

* Optimizer state is the inner optimizer's, by key (``"exp_avg"``); it exists after the first
  step. A full-gradient transform's buffers (Muon's momentum) are not reachable here.
* Gradients are the reduced, accumulated gradients the next step applies; they exist between
  the backward pass that ends an accumulation cycle and ``step()`` (or ``zero_grad()``), and the
  getters return ``None`` at any other time. Under fp16 they still carry the loss scale, as in
  DeepSpeed (divide by ``engine.loss_scale``).
* A parameter the owner does not train because it is frozen gives ``None`` (DeepSpeed's answer for
  a parameter without an fp32 copy); a trainable one the owner does not hold is a `ConfigError`.
* Setting the fp32 parameter also updates the model's parameter (its copy in the model dtype),
  so the next forward uses it; ``safe_set_local_fp32_param`` therefore gathers the parameter and
  is a collective too (every rank passes its own piece).

At stage 3 the owner is the `Stage3Optimizer` (``deepshard.zero._stage3_owner``): the same
shard maps, over each unit's partition; setting a parameter also writes the model's partition.
With ``offload_optimizer`` (stages 1-3) the master and the CPU Adam kernel's moments are read
from and written to the host buffers, or through the NVMe swap files
(`deepshard.zero._offload_access`).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol, TypeAlias, runtime_checkable

import torch

from deepshard.comm import all_reduce
from deepshard.interface import ShardMap, ShardPiece
from deepshard.interface.errors import CommError, ConfigError

__all__ = [
    "PartitionedOwner",
    "StateKind",
    "safe_get_full_fp32_param",
    "safe_get_full_grad",
    "safe_get_full_optimizer_state",
    "safe_get_local_fp32_param",
    "safe_get_local_grad",
    "safe_get_local_optimizer_state",
    "safe_set_full_fp32_param",
    "safe_set_full_grad",
    "safe_set_full_optimizer_state",
    "safe_set_local_fp32_param",
    "safe_set_local_grad",
    "safe_set_local_optimizer_state",
]

StateKind: TypeAlias = Literal["fp32", "grad", "state"]
"""What `PartitionedOwner.local_views` returns: the fp32 master, the reduced gradient, or an
optimizer state."""


@runtime_checkable
class PartitionedOwner(Protocol):
    """What the ``safe_get_*`` / ``safe_set_*`` functions need from a parameter's owner.

    ``ZeroOptimizer`` implements it for stages 0-2, its ``Stage3Optimizer`` for stage 3.
    """

    @property
    def partition_group(self) -> torch.distributed.ProcessGroup:
        """The group the shard maps' ranks refer to (the full getters all-reduce over it)."""
        ...

    def param_group(self, param: torch.Tensor) -> torch.distributed.ProcessGroup:
        """The group ``param``'s map is over: `partition_group`, or, for a model with several
        reduction groups (experts and dense parameters), the group of ``param``'s own unit."""
        ...

    def param_shard_map(self, param: torch.Tensor) -> ShardMap | None:
        """Where the parameter's fp32 master elements live: one box (the parameter's shape, a
        slice under tensor parallelism; a fused weight's slice is several boxes back to back)
        cut into flat pieces over `partition_group`.

        Returns:
            ``None`` for a frozen parameter the owner does not train.

        Raises:
            ConfigError: A trainable parameter the owner does not hold.
        """
        ...

    def local_views(
        self, param: torch.Tensor, kind: StateKind, key: str | None = None
    ) -> list[torch.Tensor] | None:
        """Writable 1-D views of this rank's elements of ``kind`` for ``param``; concatenated,
        they are the rank's pieces (``shard_map.pieces_of(rank)``) back to back.

        Args:
            param: A parameter `param_shard_map` maps.
            kind: ``"fp32"`` (the master), ``"grad"`` (the reduced gradient) or ``"state"``.
            key: The optimizer-state key, for ``"state"``.

        Returns:
            ``None`` for ``"grad"`` when no reduced gradient exists now.

        Raises:
            ConfigError: ``key`` is not a state of the inner optimizer.
        """
        ...

    def store_local_views(
        self,
        param: torch.Tensor,
        kind: StateKind,
        key: str | None,
        views: Sequence[torch.Tensor],
    ) -> None:
        """Keep what a setter wrote into ``views`` (from `local_views` with the same
        arguments): nothing to do where they are the storage itself; with NVMe optimizer
        offload they are copies read from the swap files, written back here."""
        ...

    def write_model_param(self, param: torch.Tensor, value: torch.Tensor) -> None:
        """Write the whole fp32 ``value`` into the model's own copy of ``param`` on this rank
        (its part of it, where the model copy is partitioned)."""
        ...


def _storage(
    shard_map: ShardMap,
) -> tuple[tuple[int, ...], dict[tuple[tuple[int, ...], tuple[int, ...]], int]]:
    """The shape of the tensor a group's map cuts, and where each of its boxes starts in it.

    One box is the parameter's shape (a slice under tensor parallelism). A fused weight's slice
    (``Shard(dim, parts)``) is several boxes back to back in the parameter's storage; they
    appear in storage order when the pieces are read by rank and local offset (each rank holds
    a later range than the one before it, or the whole tensor)."""
    boxes: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    for piece in sorted(shard_map.pieces, key=lambda p: (p.rank, p.local_offset)):
        if (piece.box_offset, piece.box_shape) not in boxes:
            boxes.append((piece.box_offset, piece.box_shape))
    if len(boxes) == 1:
        return boxes[0][1], {boxes[0]: 0}
    # along each dim, the boxes' distinct offsets each bring their extent (a fused split's
    # parts along its dim; the local experts of a stack along the dims before it)
    shape = tuple(
        sum(dict((offset[d], box[d]) for offset, box in boxes).values())
        for d in range(len(shard_map.global_shape))
    )
    if sum(math.prod(box) for _, box in boxes) != math.prod(shape):
        raise CommError(
            f"the shard map's {len(boxes)} boxes of a {shard_map.global_shape} tensor do not "
            "make up one local tensor; the owner's map must cut one box, or a fused weight's "
            "boxes (Shard(dim, parts)), over its group"
        )
    starts, base = {}, 0
    for box in boxes:
        starts[box] = base
        base += math.prod(box[1])
    return shape, starts


def _needs_sum(found: _Located, numel: int, group_size: int) -> bool:
    """False when every rank of the group holds the whole tensor; True for disjoint pieces."""
    held: dict[int, int] = {}
    for piece in found.shard_map.pieces:
        held[piece.rank] = held.get(piece.rank, 0) + piece.numel
    if sum(count == numel for count in held.values()) == group_size:
        return False
    spans = sorted(found.span(p) for p in found.shard_map.pieces if p.numel)
    if any(a_stop > b_start for (_, a_stop), (b_start, _) in itertools.pairwise(spans)):
        raise CommError(
            "the shard map mixes overlapping and partial pieces; the safe_get functions gather "
            "replicated or disjoint pieces only"
        )
    return True


def _concat(views: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """A new fp32 tensor of the views' elements back to back."""
    if not views:
        return torch.zeros(0, dtype=torch.float32, device=device)
    return torch.cat([v.reshape(-1).float() for v in views])


@dataclass(frozen=True)
class _Located:
    """A parameter's shard map, its box (the parameter's shape) and this rank's pieces."""

    shard_map: ShardMap
    shape: tuple[int, ...]
    pieces: tuple[ShardPiece, ...]
    views: list[torch.Tensor] | None
    starts: dict[tuple[tuple[int, ...], tuple[int, ...]], int]
    group: torch.distributed.ProcessGroup
    """The group the map is over (`PartitionedOwner.param_group`)."""
    """Where each box of the map starts in the parameter's storage (0 for its one box)."""

    def span(self, piece: ShardPiece) -> tuple[int, int]:
        """``piece``'s elements as a range of the parameter's flat storage."""
        start = self.starts[(piece.box_offset, piece.box_shape)] + piece.flat_start
        return start, start + piece.numel


def _locate(
    param: torch.Tensor, owner: PartitionedOwner, kind: StateKind, key: str | None
) -> _Located | None:
    """Where ``param``'s ``kind`` lives on this rank; ``None`` for a frozen parameter."""
    shard_map = owner.param_shard_map(param)
    if shard_map is None:
        return None
    group = owner.param_group(param)
    pieces = shard_map.pieces_of(group.rank())
    views = owner.local_views(param, kind, key)
    shape, starts = _storage(shard_map)
    return _Located(shard_map, shape, pieces, views, starts, group)


def _gather(found: _Located, owner: PartitionedOwner, device: torch.device) -> torch.Tensor:
    """The whole tensor from every rank's pieces (an all-reduce unless replicated)."""
    full = torch.zeros(math.prod(found.shape), dtype=torch.float32, device=device)
    local = _concat(found.views or [], device)
    start = 0
    for piece in found.pieces:
        lo, hi = found.span(piece)
        full[lo:hi].copy_(local[start : start + piece.numel])
        start += piece.numel
    if _needs_sum(found, full.numel(), found.group.size()):
        all_reduce(full, group=found.group).wait()
    return full.view(found.shape)


def _get(
    param: torch.Tensor, owner: PartitionedOwner, kind: StateKind, key: str | None, *, full: bool
) -> torch.Tensor | None:
    found = _locate(param, owner, kind, key)
    if found is None or found.views is None:
        return None
    if not full:
        return _concat(found.views, param.device)
    return _gather(found, owner, param.device)


def _value(value: object, numel: int, shape: Sequence[int], what: str) -> torch.Tensor:
    """``value`` as a flat fp32 tensor of ``numel`` elements."""
    if not isinstance(value, torch.Tensor) or value.numel() != numel:
        got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        raise ConfigError(
            f"{what} needs a tensor of {numel} elements (shape {tuple(shape)}), got {got}"
        )
    return value.detach().reshape(-1).float()


def _set(
    param: torch.Tensor,
    value: object,
    owner: PartitionedOwner,
    kind: StateKind,
    key: str | None,
    *,
    full: bool,
) -> None:
    what = f"safe_set_{'full' if full else 'local'}_{_NAMES[kind]}"
    found = _locate(param, owner, kind, key)
    if found is None:
        return  # a frozen parameter: nothing trains it
    if found.views is None:
        raise CommError(
            f"{what}: no reduced gradient exists now; gradients live between the backward pass "
            "that ends an accumulation cycle and step()"
        )
    whole = _value(value, math.prod(found.shape), found.shape, what) if full else None
    if whole is not None:
        spans = [found.span(p) for p in found.pieces]
        local = _concat([whole[lo:hi] for lo, hi in spans], param.device)
    else:
        numel = sum(p.numel for p in found.pieces)
        local = _value(value, numel, (numel,), what)
    with torch.no_grad():
        start = 0
        for view in found.views:
            view.copy_(local[start : start + view.numel()].view(view.shape))
            start += view.numel()
    owner.store_local_views(param, kind, key, found.views)
    if kind == "fp32":  # the model's copy follows (the local setter gathers the whole master)
        model = _gather(found, owner, param.device) if whole is None else whole.view(found.shape)
        owner.write_model_param(param, model)


_NAMES = {"fp32": "fp32_param", "grad": "grad", "state": "optimizer_state"}


def safe_get_full_fp32_param(param: torch.Tensor, owner: PartitionedOwner) -> torch.Tensor | None:
    """The whole fp32 master of ``param`` (a collective over the owner's group).

    Returns:
        A new fp32 tensor shaped like the parameter; ``None`` for a frozen parameter.
    """
    return _get(param, owner, "fp32", None, full=True)


def safe_get_full_grad(param: torch.Tensor, owner: PartitionedOwner) -> torch.Tensor | None:
    """The whole reduced fp32 gradient of ``param`` (a collective over the owner's group).

    Returns:
        ``None`` outside the window from the accumulation boundary's backward pass to ``step()``
        (on every rank alike), or for a frozen parameter.
    """
    return _get(param, owner, "grad", None, full=True)


def safe_get_full_optimizer_state(
    param: torch.Tensor, owner: PartitionedOwner, optim_state_key: str
) -> torch.Tensor | None:
    """The whole fp32 optimizer state ``optim_state_key`` of ``param`` (a collective).

    Raises:
        ConfigError: The inner optimizer has no such state (none before its first step).
    """
    return _get(param, owner, "state", optim_state_key, full=True)


def safe_get_local_fp32_param(param: torch.Tensor, owner: PartitionedOwner) -> torch.Tensor | None:
    """This rank's elements of the fp32 master of ``param``, 1-D (no collective)."""
    return _get(param, owner, "fp32", None, full=False)


def safe_get_local_grad(param: torch.Tensor, owner: PartitionedOwner) -> torch.Tensor | None:
    """This rank's elements of the reduced gradient of ``param``, 1-D, or ``None`` when no
    reduced gradient exists now (no collective)."""
    return _get(param, owner, "grad", None, full=False)


def safe_get_local_optimizer_state(
    param: torch.Tensor, owner: PartitionedOwner, optim_state_key: str
) -> torch.Tensor | None:
    """This rank's elements of the optimizer state ``optim_state_key`` of ``param``, 1-D."""
    return _get(param, owner, "state", optim_state_key, full=False)


def safe_set_full_fp32_param(
    param: torch.Tensor, owner: PartitionedOwner, value: torch.Tensor
) -> None:
    """Set the whole fp32 master of ``param`` and the model's parameter to ``value``.

    Every rank of the owner's group must call it with the same ``value`` (each keeps its part).

    Raises:
        ConfigError: ``value`` does not have the parameter's number of elements.
    """
    _set(param, value, owner, "fp32", None, full=True)


def safe_set_full_grad(param: torch.Tensor, owner: PartitionedOwner, value: torch.Tensor) -> None:
    """Replace the whole reduced gradient of ``param`` (same ``value`` on every rank).

    Raises:
        CommError: No reduced gradient exists now.
        ConfigError: ``value`` has the wrong number of elements.
    """
    _set(param, value, owner, "grad", None, full=True)


def safe_set_full_optimizer_state(
    param: torch.Tensor, owner: PartitionedOwner, value: torch.Tensor, optim_state_key: str
) -> None:
    """Set the whole optimizer state ``optim_state_key`` of ``param`` (same ``value`` on every
    rank).

    Raises:
        ConfigError: No such state, or ``value`` has the wrong number of elements.
    """
    _set(param, value, owner, "state", optim_state_key, full=True)


def safe_set_local_fp32_param(
    param: torch.Tensor, owner: PartitionedOwner, value: torch.Tensor
) -> None:
    """Set this rank's elements of the fp32 master of ``param``, then refresh the model's
    parameter from the whole master: a collective, every rank passing its own piece.

    Raises:
        ConfigError: ``value`` does not have this rank's number of elements.
    """
    _set(param, value, owner, "fp32", None, full=False)


def safe_set_local_grad(param: torch.Tensor, owner: PartitionedOwner, value: torch.Tensor) -> None:
    """Set this rank's elements of the reduced gradient of ``param`` (no collective).

    Raises:
        CommError: No reduced gradient exists now.
        ConfigError: ``value`` has the wrong number of elements.
    """
    _set(param, value, owner, "grad", None, full=False)


def safe_set_local_optimizer_state(
    param: torch.Tensor, owner: PartitionedOwner, value: torch.Tensor, optim_state_key: str
) -> None:
    """Set this rank's elements of the optimizer state ``optim_state_key`` (no collective).

    Raises:
        ConfigError: No such state, or ``value`` has the wrong number of elements.
    """
    _set(param, value, owner, "state", optim_state_key, full=False)
