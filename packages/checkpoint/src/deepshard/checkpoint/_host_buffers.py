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

import atexit
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


def _host_like(tensor: torch.Tensor) -> torch.Tensor:
    """A host buffer for ``tensor``, pinned when it is on a CUDA device (a faster transfer)."""
    return torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=tensor.device.type == "cuda")


def snapshot(plan: RankPlan, *, copy: bool, reuse: Mapping[str, torch.Tensor]) -> RankPlan:
    """The plan with its tensors as contiguous CPU memory, copied if ``copy`` (background).

    Each entry is copied into the buffer of the same key in ``reuse`` (a previous background
    save's buffers, or `prepare_async_save`'s) when its shape and dtype match, else into a
    fresh one; either way one copy per tensor.
    """
    if not copy and all(t.device.type == "cpu" and t.is_contiguous() for _, t in plan.entries):
        return plan
    entries = []
    for key, tensor in plan.entries:
        buffer = reuse.get(key) if copy else None
        if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
            buffer = _host_like(tensor)
        entries.append((key, buffer.copy_(tensor)))
    return RankPlan(entries, plan.pieces, plan.shapes)


def _fill(plan: RankPlan, handle: SaveHandle) -> None:
    try:
        buffers = {key: _host_like(tensor) for key, tensor in plan.entries}
        for buffer in buffers.values():
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

    Pass the returned handle as ``after=`` to the first ``save(..., async_save=True)``: each
    tensor of that save with the key, shape and dtype of one here (the values do not matter)
    is only copied, as later saves given the previous handle are; any other (a new key, a
    changed shape) gets a fresh buffer, as without this call. The buffers
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
    # Waited for at exit like a background save: a daemon thread still inside torch (C++) when
    # the interpreter finalizes makes the process abort instead of exiting.
    atexit.register(handle._wait_at_exit)
    threading.Thread(
        target=_fill, args=(plan, handle), name="deepshard-checkpoint-prepare", daemon=True
    ).start()
    return handle
