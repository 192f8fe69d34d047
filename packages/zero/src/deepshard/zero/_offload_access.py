"""The ``safe_get_*`` / ``safe_set_*`` functions' view of offloaded masters and Adam moments.

With ``offload_optimizer`` (stages 1-3) a parameter's fp32 master and, when DeepShard's CPU
Adam kernel steps, its ``exp_avg`` / ``exp_avg_sq`` are not on the device:

* ``device: "cpu"`` (`HostState`): they are host buffers, whole per partition; the accessors get
  views of them and write into them in place (with a partial offload, the buffers' mirror of
  the device sub-groups is refreshed first and read back after a write).
* ``device: "nvme"`` (`NvmeState`): they are in files between steps. A getter reads the
  requested ranges into fresh host tensors (`NvmeState.read_range`); a setter writes what it
  put into those tensors back into the files (`NvmeState.write_range`, through `store`), so the
  next step reads the new values. Moments of a sub-group never stepped are zero, not in the
  file, as the step itself treats them.

An optimizer stepped as itself on host master views (``device: "cpu"`` only) keeps its own
state, which the owners read from the inner optimizer as without offload (`state_name` says
``None``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from deepshard.interface.errors import ConfigError
from deepshard.zero._offload import HostOffload
from deepshard.zero._offload_state import STATE_NAMES, HostState

__all__ = ["offloaded_views", "state_name", "store_offloaded"]

Spans = Sequence[tuple[int, int]]
"""``[lo, hi)`` ranges of one partition (or unit master)."""

_MOMENTS = ("exp_avg", "exp_avg_sq")


def _kernel(offload: HostOffload) -> bool:
    """Whether the CPU Adam kernel steps (moments in the offload's own state)."""
    state = offload.state
    return not isinstance(state, HostState) or bool(state.moments)


def state_name(offload: HostOffload, kind: str, key: str | None) -> str | None:
    """Which offloaded tensor (`STATE_NAMES`) holds ``kind`` / ``key``; ``None``: the inner
    optimizer's own state.

    Raises:
        ConfigError: ``key`` is not one of the CPU Adam kernel's moments.
    """
    if kind == "fp32":
        return "master"
    if not _kernel(offload):
        return None
    if key not in _MOMENTS:
        raise ConfigError(
            f"the offloaded optimizer (DeepShard's CPU Adam kernel) has no per-element state "
            f"{key!r}; it holds {list(_MOMENTS)}"
        )
    return key


def offloaded_views(
    offload: HostOffload, group: int, name: str, spans: Spans
) -> list[torch.Tensor]:
    """Host tensors of ``name``'s ranges ``spans`` of partition ``group``.

    Views of the buffers themselves with ``device: "cpu"``; fresh copies read from the files
    with ``"nvme"`` (write them back with `store_offloaded`).
    """
    state = offload.state
    if isinstance(state, HostState):
        offload.mirror_device_share()  # partial offload: its device sub-groups, up to date
        tensor = state.whole()[STATE_NAMES.index(name)][group]
        return [tensor[lo:hi] for lo, hi in spans]
    return [state.read_range(group, name, lo, hi) for lo, hi in spans]


def store_offloaded(
    offload: HostOffload,
    group: int,
    name: str,
    spans: Spans,
    views: Sequence[torch.Tensor],
) -> None:
    """Write ``views`` (from `offloaded_views`, changed) back into the files (NVMe); with
    host buffers they were the buffers, so nothing is left to do."""
    state = offload.state
    if isinstance(state, HostState):
        offload.reload_device_share()  # partial offload: its device sub-groups take the writes
        return
    for (lo, _), view in zip(spans, views, strict=True):
        state.write_range(group, name, lo, view)
