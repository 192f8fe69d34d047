"""Offline conversions in one process: DeepSpeed import and resharding to N ranks' files.

``reshard`` writes the checkpoint ``N`` data-parallel ranks at a ZeRO stage would write, without
starting them: the source is read whole (`load_state_dict_from_checkpoint`), each tensor gets
the target stage's `ShardMap`, and `save_resharded` cuts every rank's storage with the copies a
resharding load makes and writes each rank's file as that rank's save would. Only ``module/``
and ``optimizer/`` tensors with at least one dimension are sharded; scalars, RNG rows and the
rest stay replicated.

Layouts written (what a ZeRO run of that stage holds, each rank's pieces from local offset 0):
stage 0 replicates; stages 1-2 cut each kind's tensors, concatenated in key order, into ``N``
equal flat partitions (so a rank may hold the tail of one tensor and the head of the next);
stage 3 cuts every tensor on its own into ``ceil(numel / N)``-element pieces.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from deepshard.checkpoint._deepspeed_import import MOMENTS, DeepSpeedState, read_deepspeed
from deepshard.checkpoint._layout import check_tag, read_metadata, tag_dir_of
from deepshard.checkpoint._load import load_state_dict_from_checkpoint
from deepshard.checkpoint._offline import save_resharded
from deepshard.checkpoint._save import save
from deepshard.interface import ShardMap
from deepshard.interface.errors import CheckpointError

__all__ = ["deepspeed_state_dict", "import_deepspeed", "reshard"]

Progress = Callable[[str], None]
_SHARDED_PREFIXES = ("module/", "optimizer/")


def deepspeed_state_dict(ds: DeepSpeedState) -> dict[str, torch.Tensor]:
    """The engine's checkpoint keys for a DeepSpeed state (``module/<name>`` is the fp32 master,
    ``optimizer/<name>/<moment>``, ``optimizer/param_groups.<g>/step``)."""
    state: dict[str, torch.Tensor] = {}
    for name, master in ds.masters.items():
        state[f"module/{name}"] = master
        for moment in MOMENTS:
            state[f"optimizer/{name}/{moment}"] = ds.moments[moment][name]
    for name, tensor in ds.extra.items():
        state[f"module/{name}"] = tensor
    for group, step in enumerate(ds.steps):
        state[f"optimizer/param_groups.{group}/step"] = torch.tensor(step, dtype=torch.float32)
    return state


def import_deepspeed(
    ds_dir: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    tag: str | None = None,
    out_tag: str | None = None,
    progress: Progress | None = None,
) -> Path:
    """Convert a DeepSpeed checkpoint into a DeepShard one (one process, no process group).

    Returns:
        The written tag directory (``out_tag``, by default the DeepSpeed tag's name).
    """
    ds = read_deepspeed(ds_dir, tag, progress=progress)
    source = Path(ds_dir)
    name = out_tag or (tag if tag is not None else _default_tag(source, ds))
    metadata: dict[str, Any] = {
        "engine": {**ds.counters, "param_groups": [list(g) for g in ds.groups]},
        "imported_from": {
            "format": "deepspeed",
            "layout": ds.layout,
            "ds_version": ds.ds_version,
            "dp_world_size": ds.dp_world_size,
        },
    }
    handle = save(deepspeed_state_dict(ds), out_dir, tag=check_tag(name), metadata=metadata)
    return handle.wait()


def _default_tag(source: Path, ds: DeepSpeedState) -> str:
    latest = source / "latest"
    if latest.is_file():
        return latest.read_text().strip()
    steps = ds.counters.get("global_steps")
    return f"global_step{steps}" if steps else source.name.removesuffix("_universal")


def _bounds_flat(
    shapes: list[tuple[str, int]], world: int
) -> dict[str, list[tuple[int, int, int]]]:
    """Stages 1-2: ``(rank, start, stop)`` of every tensor in one flat buffer cut ``world`` ways."""
    total = sum(n for _, n in shapes)
    width = max(1, math.ceil(total / world))
    out: dict[str, list[tuple[int, int, int]]] = {}
    offset = 0
    for name, numel in shapes:
        out[name] = [
            (r, max(lo, offset) - offset, min(lo + width, offset + numel) - offset)
            for r, lo in ((r, r * width) for r in range(world))
            if max(lo, offset) < min(lo + width, offset + numel)
        ]
        offset += numel
    return out


def _bounds_each(numel: int, world: int) -> list[tuple[int, int, int]]:
    width = max(1, math.ceil(numel / world))
    return [(r, r * width, min(numel, (r + 1) * width)) for r in range(world) if r * width < numel]


def _layouts(tensors: Mapping[str, Any], world: int, stage: int) -> dict[str, ShardMap | None]:
    """Each key's target map (``None``: kept replicated)."""
    sharded = {
        n: e["shard_map"]
        for n, e in tensors.items()
        if n.startswith(_SHARDED_PREFIXES) and e["shard_map"]["global_shape"]
    }
    layouts: dict[str, ShardMap | None] = {n: None for n in tensors}
    if stage == 0 or world == 1:
        return layouts
    kinds: dict[str, list[tuple[str, int]]] = {}
    for name, smap in sharded.items():
        kind = name.rsplit("/", 1)[1] if name.startswith("optimizer/") else "module"
        kinds.setdefault(kind, []).append((name, math.prod(smap["global_shape"])))
    for members in kinds.values():
        flat = _bounds_flat(members, world) if stage in (1, 2) else None
        for name, numel in members:
            bounds = flat[name] if flat is not None else _bounds_each(numel, world)
            smap = sharded[name]
            layouts[name] = ShardMap.flat_partition(
                smap["global_shape"], smap["dtype"], bounds=bounds
            )
    return layouts


def reshard(
    path: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    dp: int,
    stage: int = 2,
    tag: str | None = None,
    progress: Progress | None = None,
) -> Path:
    """Write ``path``'s checkpoint as ``dp`` ranks at ZeRO ``stage`` would hold it.

    Raises:
        CheckpointError: A bad ``dp``/``stage``, or a damaged source checkpoint.
    """
    if isinstance(dp, bool) or not isinstance(dp, int) or dp < 1:
        raise CheckpointError(f"--dp {dp!r}: the data-parallel size must be an int >= 1")
    if stage not in (0, 1, 2, 3):
        raise CheckpointError(f"--stage {stage!r}: the ZeRO stage must be 0, 1, 2 or 3")
    source = tag_dir_of(path, tag)
    meta = read_metadata(source)
    layouts = _layouts(meta["tensors"], dp, stage)
    if progress is not None:
        progress(f"reading {source.name}")
    state = load_state_dict_from_checkpoint(source)
    if progress is not None:
        progress(f"writing {dp} rank(s)")
    maps = {name: smap for name, smap in layouts.items() if smap is not None}
    return save_resharded(
        state, maps, out_dir, tag=str(meta["tag"]), world_size=dp, metadata=meta["metadata"]
    )
