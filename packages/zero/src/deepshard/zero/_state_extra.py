"""The ZeRO state shards that are not per-element state of a master: scalars and Muon momentum.

* Scalars (Adam's ``step``): one replicated 0-d entry per inner param group, named
  ``param_groups.<g>``; the CPU Adam kernel's own step count under offload is the same entry.
* ``momentum_buffer``: a full-gradient transform's buffer (Muon's momentum), whole per matrix,
  one identical copy on every rank holding a piece of it (each computes it from the whole
  reduced gradient).
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch

from deepshard.interface import ShardMap, ShardPiece
from deepshard.zero._state_entry import StateShard, Writer, dtype_name, replicated, splitter
from deepshard.zero._state_regions import Regions

if TYPE_CHECKING:
    from deepshard.zero.optimizer import ZeroOptimizer

__all__ = ["MOMENTUM", "materialize_buffers", "momentum_entries", "scalar_entries"]


def _scalar_values(
    inner: torch.optim.Optimizer, regions: Regions
) -> list[dict[str, list[tuple[dict[str, Any], Any]]]]:
    """Per param group, each scalar state key with every ``(state dict, value)`` holding it."""
    groups: list[dict[str, list[tuple[dict[str, Any], Any]]]] = []
    for group in inner.param_groups:
        found: dict[str, list[tuple[dict[str, Any], Any]]] = {}
        for view in group["params"]:
            state = inner.state.get(view, {})
            for key, value in state.items():
                scalar = isinstance(value, torch.Tensor) and value.dim() == 0
                if scalar or isinstance(value, numbers.Number):
                    found.setdefault(key, []).append((state, value))
        groups.append(found)
    if regions.kernel_steps is not None:  # the CPU Adam kernel counts steps itself
        for found in groups:
            found["step"] = [({}, float(max(regions.kernel_steps, default=0)))]
    # ZeRO steps every group at every step, so a group this rank holds no element of takes
    # another group's value (every rank then writes the same entries; loading it does nothing)
    for found in groups:
        for other in groups:
            for key, holders in other.items():
                if key not in found:
                    value = holders[0][1]
                    copy = value.clone() if isinstance(value, torch.Tensor) else value
                    found[key] = [({}, copy)]
    return groups


def scalar_entries(
    opt: ZeroOptimizer, regions: Regions, maps: Sequence[ShardMap]
) -> list[tuple[StateShard, Writer | None]]:
    ranks = opt.partition_group.size()
    out: list[tuple[StateShard, Writer | None]] = []
    for g, found in enumerate(_scalar_values(opt.inner, regions)):
        for key, holders in sorted(found.items()):
            first = holders[0][1]
            tensor = first if isinstance(first, torch.Tensor) else torch.tensor(first)
            smap = replicated(maps, tensor.dtype, ranks)
            writer = _scalar_writer(key, holders, regions)
            out.append((StateShard(f"param_groups.{g}", key, smap, tensor), writer))
    return out


def _scalar_writer(key: str, holders: list[tuple[dict[str, Any], Any]], regions: Regions) -> Writer:
    def write(value: torch.Tensor) -> None:
        with torch.no_grad():
            for state, old in holders:
                if isinstance(old, torch.Tensor):
                    if value.data_ptr() != old.data_ptr():
                        old.copy_(value.reshape(old.shape))
                elif state:
                    state[key] = type(old)(value.item())
        if regions.kernel_steps is not None and key == "step" and not holders[0][0]:
            regions.kernel_steps[:] = [int(value.item())] * len(regions.kernel_steps)

    return write


MOMENTUM = "momentum_buffer"
"""The kind of a full-gradient transform's buffer (Muon's momentum), one per matrix."""


def _holders_map(smap: ShardMap, dtype: torch.dtype) -> ShardMap:
    """The whole box, held by every rank that holds a piece of ``smap`` (each keeps a copy)."""
    pieces = tuple(
        ShardPiece(p.rank, p.box_offset, p.box_shape, coords=p.coords)
        for p in smap.pieces
        if p.numel
    )
    return replace(smap, dtype=dtype_name(dtype), pieces=pieces)


def momentum_entries(regions: Regions) -> list[tuple[StateShard, Writer | None]]:
    """Muon's momentum of every matrix this rank transforms (whole, on each holder)."""
    full = regions.full
    if full is None:
        return []
    buffers = full.buffers
    out: list[tuple[StateShard, Writer | None]] = []
    for place in regions.params:
        buffer = buffers.get(place.shard.name)
        if buffer is None:
            continue
        smap = _holders_map(place.shard.shard_map, buffer.dtype)
        entry = StateShard(place.shard.name, MOMENTUM, smap, buffer.view(-1))
        out.append((entry, splitter([buffer.view(-1)])))
    return out


def materialize_buffers(regions: Regions) -> None:
    """Zero momentum for every matrix this rank transforms and has none for yet, in the model
    dtype (the gradients'; the transform converts a buffer of another dtype on first use)."""
    full = regions.full
    if full is None:
        return
    places = {place.shard.name: place for place in regions.params}
    buffers = full.buffers
    for name, shape in full.target_shapes.items():
        if name not in buffers:
            place = places[name]
            device = regions.regions[place.region].master.device
            buffers[name] = torch.zeros(shape, dtype=place.model_dtype, device=device)
