"""The host snapshot a background save copies the state into, and getting it ready early.

A background save must copy every shard before ``save`` returns (training then changes them).
Copying into memory the process already holds is a plain memcpy; copying into fresh memory
also makes the kernel zero and map a page per 4 KiB on first touch, which on the machines
measured cost 3-4x the copy itself, so a first background save blocked ~0.2x a synchronous
save while later ones, reusing the previous save's buffers (``after=``), blocked ~0.04x.
`prepare_async_save` moves that first-touch cost off the training thread: it allocates and
touches the buffers a save of the given state will need on a helper thread, while training
goes on, and returns a `SaveHandle` holding them, to pass as ``after=`` to the first
background save.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from pathlib import Path

import torch

from deepshard.checkpoint._exchange import members_of
from deepshard.checkpoint._handle import SaveHandle
from deepshard.checkpoint._plan import RankPlan, plan_rank
from deepshard.checkpoint._types import StateValue, state_items
from deepshard.comm import Group

__all__ = ["prepare_async_save", "snapshot"]


def _allocate(plan: RankPlan) -> list[torch.Tensor]:
    """One host buffer per entry, pinned when its source is on a CUDA device."""
    return [
        torch.empty(t.shape, dtype=t.dtype, pin_memory=t.device.type == "cuda")
        for _, t in plan.entries
    ]


def _matches(buffers: list[torch.Tensor], entries: list[tuple[str, torch.Tensor]]) -> bool:
    return len(buffers) == len(entries) and all(
        b.shape == t.shape and b.dtype == t.dtype
        for b, (_, t) in zip(buffers, entries, strict=True)
    )


def snapshot(plan: RankPlan, *, copy: bool, reuse: list[torch.Tensor]) -> RankPlan:
    """The plan with its tensors as contiguous CPU memory, copied if ``copy`` (background).

    A copy goes into ``reuse`` (a previous background save's buffers, or `prepare_async_save`'s)
    when they match the entries one for one, else into fresh buffers; either way one copy per
    tensor.
    """
    if not copy and all(t.device.type == "cpu" and t.is_contiguous() for _, t in plan.entries):
        return plan
    if not copy or not _matches(reuse, plan.entries):
        reuse = _allocate(plan)
    entries = [(k, buffer.copy_(t)) for (k, t), buffer in zip(plan.entries, reuse, strict=True)]
    return RankPlan(entries, plan.pieces, plan.shapes)


def _fill(plan: RankPlan, handle: SaveHandle) -> None:
    try:
        buffers = _allocate(plan)
        for buffer in buffers:
            buffer.view(-1).view(torch.uint8).zero_()  # touch every page now, not in save()
        handle._host_buffers = buffers
    except BaseException as exc:
        handle._finish(exc)
    else:
        handle._finish(None)


def prepare_async_save(
    state: Mapping[str, StateValue], *, group: Group | None = None
) -> SaveHandle:
    """Get a background save's host buffers ready on a helper thread; returns at once.

    Pass the returned handle as ``after=`` to the first ``save(..., async_save=True)`` of a
    state with the same tensors (shapes and dtypes; the values do not matter): that save then
    only copies, as later saves given the previous handle do. If the state has changed shape
    by then, the save allocates fresh buffers as it would have without this call. The buffers
    hold one copy of this rank's share of the state until the save that takes them finishes.

    Args:
        state: The state the background saves will save (as for `save`).
        group: The ranks saving (as for `save`); only this rank's share is allocated.

    Returns:
        A `SaveHandle` that is done once the buffers are ready (its ``path`` is empty: it
        saves nothing).
    """
    plan = plan_rank(state_items(state), members_of(group).rank)
    handle = SaveHandle(Path())
    threading.Thread(
        target=_fill, args=(plan, handle), name="deepshard-checkpoint-prepare", daemon=True
    ).start()
    return handle
