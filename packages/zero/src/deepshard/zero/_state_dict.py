"""Saving and restoring one rank's ZeRO state for a run with the same layout.

The state is this rank's fp32 master partitions, the inner optimizer's own state dict (whose
tensors are partitions too) and the full-gradient transform's buffers (Muon's momentum: whole
parameters, by name, in the dtype they were kept in). Reloading needs the same partition count,
rank and partition sizes. With optimizer offload the masters come from (and go back to) the host
buffers or swap files, and the offload's own state (step counts, the CPU Adam moments as whole
partitions, `deepshard.zero._offload.HostOffload.state_dict`) is saved under ``"offload"``; such a
state loads into a run with offload to either device. Moving state between layouts (other world
sizes, other bucket sizes) goes through the shard maps (`ZeroOptimizer.shard_maps`), which is the
checkpoint package's job.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from deepshard.interface.errors import CheckpointError

if TYPE_CHECKING:
    from deepshard.interface import FullGradientPath
    from deepshard.zero._offload import HostOffload
    from deepshard.zero.optimizer import ZeroOptimizer

__all__ = ["load_partitioned_state", "partitioned_state"]

_LAYOUT_KEYS = ("partition_count", "partition_rank", "partition_numels")


def _layout_header(optimizer: ZeroOptimizer) -> dict[str, Any]:
    return {
        "partition_count": optimizer.partition_count,
        "partition_rank": optimizer.partition_rank,
        "partition_numels": [m.numel() for m in optimizer.master_partitions],
    }


def partitioned_state(
    optimizer: ZeroOptimizer, full: FullGradientPath, offload: HostOffload | None
) -> dict[str, Any]:
    """This rank's state: layout header, master partitions, the inner and offload state."""
    state = {
        **_layout_header(optimizer),
        "zero_stage": optimizer.stage,
        "master_partitions": [m.detach().clone() for m in optimizer.master_partitions],
        "optimizer": optimizer.inner.state_dict(),
        "full_grad_buffers": full.state_dict(),
    }
    if offload is not None:
        state["offload"] = offload.state_dict()
    return state


def load_partitioned_state(
    optimizer: ZeroOptimizer,
    full: FullGradientPath,
    offload: HostOffload | None,
    state: dict[str, Any],
) -> None:
    """Copy a `partitioned_state` into ``optimizer`` (masters, inner, transform, offload state).

    A state without ``full_grad_buffers`` (saved before transforms existed) loads none.

    Raises:
        CheckpointError: A key is missing, the layout differs, or a transform buffer belongs to
            no parameter this rank transforms.
    """
    missing = [k for k in (*_LAYOUT_KEYS, "master_partitions", "optimizer") if k not in state]
    if missing:
        raise CheckpointError(f"ZeRO state dict lacks {missing}; pass what state_dict() returned")
    header = _layout_header(optimizer)
    for key in _LAYOUT_KEYS:
        if state[key] != header[key]:
            raise CheckpointError(
                f"ZeRO state dict was saved with {key}={state[key]!r} but this run has "
                f"{header[key]!r}; load it with the same data-parallel size and bucket sizes, or "
                "reshard it through the shard maps (deepshard.checkpoint)"
            )
    if offload is not None:
        offload.load_state_dict(state["master_partitions"], state.get("offload"))
    else:
        _copy_masters(optimizer, state["master_partitions"])
    full.load_state_dict(state.get("full_grad_buffers", {}))
    optimizer.inner.load_state_dict(state["optimizer"])


def _copy_masters(optimizer: ZeroOptimizer, saved_masters: list[torch.Tensor]) -> None:
    with torch.no_grad():
        for master, saved in zip(optimizer.master_partitions, saved_masters, strict=True):
            master.copy_(saved)
