"""`state_shards()`: every tensor of a ZeRO optimizer as (name, kind, shard map, local tensor).

A checkpoint must not depend on how ZeRO happened to lay memory out (bucket sizes, the 1 MiB
master views the inner optimizer steps, the CPU message-size cap, offload to the host or to
files), or a checkpoint written on a GPU would not load on a CPU run of the same config. So
what ZeRO exposes is one entry per parameter and *kind*:

* ``param``: the model's own copy, in the model dtype (stages 0-2 hold it whole; stage 3 its
  partition; a stage-3 frozen parameter has nothing else);
* ``master``: the fp32 master weights;
* every per-element state tensor of the inner optimizer (``exp_avg``, ``exp_avg_sq``, ``sum``...),
  found by walking the master views that cover the parameter's piece (a piece straddling two
  views takes a slice of each);
* ``momentum_buffer`` of a full-gradient transform (Muon): whole per matrix, one copy on every
  rank holding a piece of it.

Each entry's `ShardMap` is the parameter's (derived from its placement), with the entry's dtype
and every rank's pieces laid back to back from local offset 0: the local tensor of a rank is
exactly its elements of the parameter, never the alignment or bucket padding. The tensor is a
view of the storage training reads: the masters, the model copy, and the inner optimizer's
state, whose per-view tensors are re-pointed once into one flat tensor per key laid out like
the master (`deepshard.zero._state_regions`), so a piece straddling two views is still one
slice. NVMe-offloaded masters and moments are read from their files (copies). Scalar state
(Adam's ``step``) and Muon's momentum are entries of their own (`deepshard.zero._state_extra`).

`load_state_shards` copies loaded local tensors back into those places, writes offloaded state
back to the host buffers or files, and refreshes the model from the masters (an all-gather at
stages 1-2). A fresh optimizer has no state yet; `materialize_state` creates it by stepping the
inner optimizer once with zero gradients and learning rate 0 (which leaves every master as it
is), so a checkpoint can be read into the state in place.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch

from deepshard.interface.errors import CheckpointError
from deepshard.zero._state_entry import StateShard, Writer, joined, rebased, splitter
from deepshard.zero._state_extra import materialize_buffers, momentum_entries, scalar_entries
from deepshard.zero._state_regions import ParamPlace, Region, Regions, flat_regions, stage3_regions
from deepshard.zero._tp_maps import expert_widened_entries, widened_entries

if TYPE_CHECKING:
    from deepshard.zero._stage3_optimizer import Stage3Optimizer
    from deepshard.zero.optimizer import ZeroOptimizer

__all__ = ["StateShard", "StateShardAccess"]


def _flat_like(value: object, numel: int) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > 0 and value.numel() == numel


def _state_parts(region: Region, lo: int, hi: int) -> dict[str, list[torch.Tensor]]:
    """Per state key, the slices covering ``[lo, hi)`` of ``region``'s master (whole keys only)."""
    parts: dict[str, list[torch.Tensor]] = {}
    covered: dict[str, int] = {}
    for state, start, stop in region.segments:
        a, b = max(lo, start), min(hi, stop)
        if a >= b:
            continue
        for key, value in state.items():
            if _flat_like(value, stop - start):
                parts.setdefault(key, []).append(value.view(-1)[a - start : b - start])
                covered[key] = covered.get(key, 0) + b - a
    return {k: v for k, v in parts.items() if covered[k] == hi - lo}


def _param_entries(
    place: ParamPlace, regions: Regions, rank: int
) -> list[tuple[StateShard, Writer | None]]:
    """The ``param``, ``master`` and per-element state entries of one parameter."""
    shard, frozen = place.shard, not place.trainable
    pieces = shard.shard_map.pieces_of(rank if place.group_rank is None else place.group_rank)
    region = regions.regions[place.region] if place.trainable else None
    device = region.master.device if region is not None else torch.device("cpu")
    model = joined(place.model, place.model_dtype, device)
    entry = StateShard(shard.name, "param", rebased(shard.shard_map, model.dtype), model, frozen)
    writer = None
    if place.write_model is not None:
        write_model = place.write_model

        def writer(value: torch.Tensor) -> None:
            sizes = [p.numel for p in pieces]
            for index, part in enumerate(torch.split(value.reshape(-1), sizes)):
                write_model(part, index)

    out: list[tuple[StateShard, Writer | None]] = [(entry, writer)]
    if region is None:
        return out
    spans = [(p.local_offset, p.local_offset + p.numel) for p in pieces]
    kinds: dict[str, list[torch.Tensor]] = {"master": [region.master[lo:hi] for lo, hi in spans]}
    found = [_state_parts(region, lo, hi) for lo, hi in spans]
    # a rank holding no piece names no state: it cannot tell which keys the holders have
    keys = set.intersection(*(set(f) for f in found)) if found else set()
    for key in sorted(keys):
        kinds[key] = [part for f in found for part in f.get(key, [])]
    for kind, parts in kinds.items():
        dtype = parts[0].dtype if parts else torch.float32  # only a master can have no part
        tensor = joined(parts, dtype, device)
        smap = rebased(shard.shard_map, tensor.dtype)
        out.append((StateShard(shard.name, kind, smap, tensor), splitter(parts)))
    return out


class StateShardAccess:
    """`state_shards` and its loading counterpart (a mixin of `ZeroOptimizer`, so also of
    `Stage3Optimizer`; both set the attributes used in `deepshard.zero._state_regions`)."""

    inner: torch.optim.Optimizer
    check_resident: Callable[[str], None]

    def _regions(self) -> Regions:
        if getattr(self, "stage", None) == 3:
            return stage3_regions(self)  # type: ignore[arg-type]
        return flat_regions(self)  # type: ignore[arg-type]

    def _entries(self, regions: Regions) -> list[tuple[StateShard, Writer | None]]:
        opt: ZeroOptimizer = self  # type: ignore[assignment]
        rank = opt.partition_group.rank()
        out = [e for place in regions.params for e in _param_entries(place, regions, rank)]
        maps = [place.shard.shard_map for place in regions.params]
        # scalars are replicated over the optimizer's group: lay them out like the maps over
        # all of it (expert maps cover only their own group)
        widest = max((len(m.axes) for m in maps), default=0)
        maps = [m for m in maps if len(m.axes) == widest]
        out += momentum_entries(regions) + scalar_entries(opt, regions, maps)
        keys = [entry.key for entry, _ in out]
        assert len(set(keys)) == len(keys), f"two ZeRO state shards share a key: {keys}"
        return out

    def state_shards(self) -> tuple[StateShard, ...]:
        """Every parameter, master and optimizer-state tensor of this rank (see the module).

        Under tensor parallelism the maps span the data-parallel axes and ``tp`` (ranks are
        indices in that grid: global ranks when ``pp`` is 1), so one checkpoint holds every
        TP slice.

        Raises:
            CommError: States are offloaded (``reload_states()`` first).
        """
        self.check_resident("state_shards()")
        regions = self._regions()
        entries = tuple(entry for entry, _ in self._entries(regions))
        placements = {p.shard.name: p.shard.placement for p in regions.params}
        if any(p.group_rank is not None for p in regions.params):
            # expert parameters: one map over every ep rank's experts (deepshard.zero._tp_maps)
            entries = expert_widened_entries(entries, placements)
        if getattr(self, "_tp", None) is None:
            return entries
        # tensor parallelism: one map over every TP slice (deepshard.zero._tp_maps)
        return widened_entries(entries, placements)

    def load_state_shards(self, values: Mapping[str, torch.Tensor]) -> None:
        """Copy loaded local tensors (by `StateShard.key`) into the optimizer; refresh the model.

        Keys left out keep their values; a trainable parameter's ``param`` entry is not read
        (the model is refreshed from the masters). Every rank of the group must call it (stages
        1-2 all-gather the parameters).

        Raises:
            CheckpointError: A key this optimizer does not have, or a tensor of another size.
            CommError: States are offloaded.
        """
        self.check_resident("load_state_shards()")
        regions = self._regions()
        entries = {entry.key: writer for entry, writer in self._entries(regions)}
        unknown = sorted(set(values) - set(entries))
        if unknown:
            raise CheckpointError(
                f"these ZeRO state shards belong to no tensor of this optimizer: {unknown[:5]}"
                f"{' ...' if len(unknown) > 5 else ''}; load the keys state_shards() lists"
            )
        for key, value in values.items():
            writer = entries[key]
            if writer is not None:
                writer(value)
        _finish_load(self, regions)  # type: ignore[arg-type]

    def materialize_state(self) -> None:
        """Create the inner optimizer's state (and Muon's momentum) where there is none yet, so
        a checkpoint can be loaded into it in place: one step with zero gradients at learning
        rate 0, which leaves the masters of any optimizer whose update scales with ``lr`` as
        they are (a load then overwrites masters and state alike). Nothing happens when the
        state exists."""
        self.check_resident("materialize_state()")
        materialize_buffers(self._regions())
        views = [view for group in self.inner.param_groups for view in group["params"]]
        if all(self.inner.state.get(view) for view in views):
            return
        rates = [group.get("lr") for group in self.inner.param_groups]
        try:
            for group in self.inner.param_groups:
                group["lr"] = 0.0
            for view in views:
                view.grad = torch.zeros_like(view)
            self.inner.step()
        finally:
            for group, rate in zip(self.inner.param_groups, rates, strict=True):
                group["lr"] = rate
            for view in views:
                view.grad = None


def _finish_load(opt: ZeroOptimizer, regions: Regions) -> None:
    """Write offloaded state back and bring the model's parameters up to the masters."""
    offload = regions.offload
    if offload is not None:
        saved: dict[str, Any] = {"steps": offload.steps}
        if regions.kernel_steps is not None:
            saved = {"steps": regions.kernel_steps, "exp_avg": regions.whole[1]}
            saved["exp_avg_sq"] = regions.whole[2]
        offload.load_state_dict(regions.whole[0], saved)
    if opt.stage != 3:
        opt._refresh_params()
        return
    stage3: Stage3Optimizer = opt  # type: ignore[assignment]
    if offload is None:
        stage3._masters_to_partitions()
    for unit in stage3.sharded.units:
        unit.home.flush()
    stage3.sharded.partitions_updated()
