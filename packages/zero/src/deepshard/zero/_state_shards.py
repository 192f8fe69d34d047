"""`state_shards()`: every tensor of a ZeRO optimizer as (name, kind, shard map, local tensor).

A checkpoint must not depend on how ZeRO happened to lay memory out (bucket sizes, the 1 MiB
master views the inner optimizer steps, the CPU message-size cap, offload to the host or to
files), or a checkpoint written on a GPU would not load on a CPU run of the same config. So
what ZeRO exposes is one entry per parameter and *kind*:

* ``param``: the model's own copy, in the model dtype (stages 0-2 hold it whole; stage 3 its
  partition; a stage-3 frozen parameter has nothing else);
* ``master``: the fp32 master weights;
* every per-element state tensor of the inner optimizer (``exp_avg``, ``exp_avg_sq``,
  ``momentum_buffer``, ``sum``...), found by walking the master views that cover the
  parameter's piece (a piece straddling two views takes a slice of each).

Each entry's `ShardMap` is the parameter's (derived from its placement), with the entry's dtype
and every rank's pieces laid back to back from local offset 0: the local tensor of a rank is
exactly its elements of the parameter, never the alignment or bucket padding. The tensor is a
view of live storage wherever those elements are contiguous in one tensor (masters, model
copies, the state of a piece inside one view), else a copy; NVMe-offloaded masters and moments
are read from their files. Scalar state (Adam's ``step``) is one replicated 0-d entry per param
group, named ``param_groups.<g>``.

`load_state_shards` copies loaded local tensors back into those places, writes offloaded state
back to the host buffers or files, and refreshes the model from the masters (an all-gather at
stages 1-2). A fresh optimizer has no state yet; `materialize_state` creates it by stepping the
inner optimizer once with zero gradients and learning rate 0 (which leaves every master as it
is), so a checkpoint can be read into the state in place.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch

from deepshard.interface import ShardMap, ShardPiece
from deepshard.interface.errors import CheckpointError
from deepshard.zero._state_regions import ParamPlace, Region, Regions, flat_regions, stage3_regions

if TYPE_CHECKING:
    from deepshard.zero._stage3_optimizer import Stage3Optimizer
    from deepshard.zero.optimizer import ZeroOptimizer

__all__ = ["StateShard", "StateShardAccess"]

Writer = Callable[[torch.Tensor], None]


@dataclass(frozen=True)
class StateShard:
    """One tensor of a ZeRO optimizer on this rank.

    Attributes:
        name: The parameter's fully qualified name (``param_groups.<g>`` for scalar state).
        kind: ``param``, ``master`` or the inner optimizer's state key (``exp_avg``, ``step``).
        shard_map: Where every element lives over the data-parallel group; each rank's pieces
            start at local offset 0 of its local tensor, back to back.
        tensor: This rank's elements, 1-D (0-d for scalars); a view of live storage where they
            are contiguous in one tensor, else a copy.
        frozen: The parameter is not trained (stage 3 keeps frozen parameters partitioned).
    """

    name: str
    kind: str
    shard_map: ShardMap
    tensor: torch.Tensor
    frozen: bool = False

    @property
    def key(self) -> str:
        """``<name>/<kind>``: the entry's key in a checkpoint."""
        return f"{self.name}/{self.kind}"


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _rebased(smap: ShardMap, dtype: torch.dtype) -> ShardMap:
    """``smap`` in ``dtype`` with every rank's pieces back to back from local offset 0."""
    fill: dict[int, int] = {}
    pieces = []
    for piece in sorted(smap.pieces, key=lambda p: (p.rank, p.local_offset)):
        pieces.append(replace(piece, local_offset=fill.get(piece.rank, 0)))
        fill[piece.rank] = fill.get(piece.rank, 0) + piece.numel
    return replace(smap, dtype=_dtype_name(dtype), pieces=tuple(pieces))


def _replicated(like: Sequence[ShardMap], dtype: torch.dtype, ranks: int) -> ShardMap:
    """A 0-d tensor every rank of the group holds, on the same mesh as the maps ``like``."""
    coords = {p.rank: p.coords for smap in like for p in smap.pieces}
    mesh = like[0] if like else None
    pieces = tuple(ShardPiece(r, (), (), coords=coords.get(r, ())) for r in range(ranks))
    if mesh is None or any(not p.coords for p in pieces):
        return ShardMap((), _dtype_name(dtype), tuple(ShardPiece(r, (), ()) for r in range(ranks)))
    return ShardMap((), _dtype_name(dtype), pieces, mesh.axes, mesh.mesh_axes, mesh.mesh_shape)


def _flat_like(value: object, numel: int) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > 0 and value.numel() == numel


def _joined(
    parts: Sequence[torch.Tensor], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    if len(parts) == 1:
        return parts[0]
    if not parts:
        return torch.empty(0, dtype=dtype, device=device)
    return torch.cat(list(parts))


def _splitter(parts: Sequence[torch.Tensor]) -> Writer:
    """Copies a loaded local tensor into ``parts`` (no copy when it is the one live part)."""

    def write(value: torch.Tensor) -> None:
        flat = value.reshape(-1)
        if sum(p.numel() for p in parts) != flat.numel():
            raise CheckpointError(
                f"a loaded ZeRO state shard has {flat.numel()} elements where this rank holds "
                f"{sum(p.numel() for p in parts)}; load with the shard maps of state_shards()"
            )
        start = 0
        with torch.no_grad():
            for part in parts:
                source = flat[start : start + part.numel()]
                if source.data_ptr() != part.data_ptr() or source.device != part.device:
                    part.copy_(source)
                start += part.numel()

    return write


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


def _state_dtypes(regions: Regions) -> dict[str, torch.dtype]:
    """Every per-element state key on this rank and its dtype."""
    dtypes: dict[str, torch.dtype] = {}
    for region in regions.regions:
        for state, start, stop in region.segments:
            for key, value in state.items():
                if _flat_like(value, stop - start):
                    dtypes.setdefault(key, value.dtype)
    return dtypes


def _param_entries(
    place: ParamPlace, regions: Regions, rank: int, known: Mapping[str, torch.dtype]
) -> list[tuple[StateShard, Writer | None]]:
    """The ``param``, ``master`` and per-element state entries of one parameter."""
    shard, frozen = place.shard, not place.trainable
    pieces = shard.shard_map.pieces_of(rank)
    region = regions.regions[place.region] if place.trainable else None
    device = region.master.device if region is not None else torch.device("cpu")
    model = _joined(place.model, place.model_dtype, device)
    entry = StateShard(shard.name, "param", _rebased(shard.shard_map, model.dtype), model, frozen)
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
    keys = set.intersection(*(set(f) for f in found)) if found else set(known)
    for key in sorted(keys):
        kinds[key] = [part for f in found for part in f.get(key, [])]
    for kind, parts in kinds.items():
        dtype = parts[0].dtype if parts else known.get(kind, torch.float32)
        tensor = _joined(parts, dtype, device)
        smap = _rebased(shard.shard_map, tensor.dtype)
        out.append((StateShard(shard.name, kind, smap, tensor), _splitter(parts)))
    return out


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


def _scalar_entries(
    opt: ZeroOptimizer, regions: Regions, maps: Sequence[ShardMap]
) -> list[tuple[StateShard, Writer | None]]:
    ranks = opt.partition_group.size()
    out: list[tuple[StateShard, Writer | None]] = []
    for g, found in enumerate(_scalar_values(opt.inner, regions)):
        for key, holders in sorted(found.items()):
            first = holders[0][1]
            tensor = first if isinstance(first, torch.Tensor) else torch.tensor(first)
            smap = _replicated(maps, tensor.dtype, ranks)
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
        known = _state_dtypes(regions)
        out = [e for place in regions.params for e in _param_entries(place, regions, rank, known)]
        maps = [place.shard.shard_map for place in regions.params]
        return out + _scalar_entries(opt, regions, maps)

    def state_shards(self) -> tuple[StateShard, ...]:
        """Every parameter, master and optimizer-state tensor of this rank (see the module).

        Raises:
            CommError: States are offloaded (``reload_states()`` first).
        """
        self.check_resident("state_shards()")
        return tuple(entry for entry, _ in self._entries(self._regions()))

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
        """Create the inner optimizer's state where it has none yet, leaving the masters as they
        are (one step with zero gradients at learning rate 0), so a checkpoint can be loaded
        into it in place. Nothing happens when the state exists."""
        self.check_resident("materialize_state()")
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
