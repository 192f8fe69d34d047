"""Saving and restoring one rank's ZeRO state for a run with the same layout.

The state is this rank's fp32 master partitions, the inner optimizer's own state dict (whose
tensors are partitions too) and the full-gradient transform's buffers (Muon's momentum: whole
parameters, by name, in the dtype they were kept in). Reloading needs the same partition count,
rank and partition sizes; moving state between layouts (other world sizes, other bucket sizes)
goes through the shard maps (`ZeroOptimizer.shard_maps`), which is the checkpoint package's job.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from deepshard.interface.errors import CheckpointError

if TYPE_CHECKING:
    from deepshard.zero._full_grads import FullGradTransforms
    from deepshard.zero.optimizer import ZeroOptimizer

__all__ = ["load_partitioned_state", "partitioned_state"]

_LAYOUT_KEYS = ("partition_count", "partition_rank", "partition_numels")


def _layout_header(optimizer: ZeroOptimizer) -> dict[str, Any]:
    return {
        "partition_count": optimizer.partition_count,
        "partition_rank": optimizer.partition_rank,
        "partition_numels": [m.numel() for m in optimizer.master_partitions],
    }


def partitioned_state(optimizer: ZeroOptimizer, full: FullGradTransforms) -> dict[str, Any]:
    """This rank's state: layout header, master partitions and the inner state dict."""
    return {
        **_layout_header(optimizer),
        "zero_stage": optimizer.stage,
        "master_partitions": [m.detach().clone() for m in optimizer.master_partitions],
        "optimizer": optimizer.inner.state_dict(),
        "full_grad_buffers": full.state_dict(),
    }


def load_partitioned_state(
    optimizer: ZeroOptimizer, full: FullGradTransforms, state: dict[str, Any]
) -> None:
    """Copy a `partitioned_state` into ``optimizer`` (masters, inner state, transform buffers).

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
    with torch.no_grad():
        for master, saved in zip(
            optimizer.master_partitions, state["master_partitions"], strict=True
        ):
            master.copy_(saved)
    full.load_state_dict(state.get("full_grad_buffers", {}))
    optimizer.inner.load_state_dict(state["optimizer"])
