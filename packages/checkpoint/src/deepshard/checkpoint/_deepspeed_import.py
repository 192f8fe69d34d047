"""Reading a DeepSpeed checkpoint into whole fp32 tensors: weights, Adam moments, counters.

A DeepSpeed 0.19.7 tag directory holds one of four layouts, told apart by its files:

* **ZeRO 0** (``mp_rank_00_model_states.pt`` with an ``optimizer`` entry): the module's state
  dict is the weights and ``optimizer`` a plain ``torch.optim`` state dict, whose parameter
  indices follow the module's parameters in order (shared parameters counted once).
* **ZeRO 1-2 and bf16** (``[bf16_]zero_pp_rank_<r>_mp_rank_00_optim_states.pt``): rank ``r``
  holds, per parameter group, one flat fp32 partition (``single_partition_of_fp32_groups``)
  and the inner optimizer's moments laid out like it; ``param_slice_mappings`` says where each
  parameter's fragment starts in the partition and how long it is. A parameter is its
  fragments in rank order.
* **ZeRO 3** (``zero_pp_rank_<r>_mp_rank_00_{model,optim}_states.pt``): every parameter is cut
  on its own into ``ceil(numel / world)``-element pieces, rank ``r`` holding piece ``r``; the
  rank's flat groups (``fp32_flat_groups``, and the moments of each sub-group) are its pieces
  back to back in the order of ``param_shapes``. A parameter is its pieces in rank order, cut to
  its size (the last piece is padded).
* **universal** (``zero/<name>/fp32.pt``, ``exp_avg.pt``, ``exp_avg_sq.pt``, ``step.pt``, as
  ``ds_to_universal`` writes them): each parameter's tensors whole.

Every file is read by `load_deepspeed_file` (``weights_only``, no code run). What comes out is
layout-free (`DeepSpeedState`); `_deepspeed_write` turns it into a DeepShard checkpoint.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from deepshard.checkpoint._deepspeed_files import FragmentAddress, load_deepspeed_file
from deepshard.interface.errors import CheckpointError

__all__ = ["MOMENTS", "DeepSpeedState", "read_deepspeed", "resolve_deepspeed_tag"]

MOMENTS = ("exp_avg", "exp_avg_sq")
"""The per-element optimizer state read (Adam's); other keys are refused by name."""

_RANK_FILE = re.compile(r"^(bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
Progress = Callable[[str], None]


@dataclass(frozen=True)
class DeepSpeedState:
    """A DeepSpeed checkpoint consolidated into whole tensors.

    Attributes:
        layout: ``zero-0``, ``zero-1``, ``zero-2``, ``bf16``, ``zero-3`` or ``universal``.
        dp_world_size: The data-parallel size that wrote it (1 for a universal checkpoint).
        masters: Each trained parameter's fp32 master, by fully qualified name.
        moments: Moment name (``exp_avg``, ``exp_avg_sq``) -> parameter name -> fp32 tensor.
        steps: Adam's step count of every parameter group, in group order.
        extra: Buffers and frozen parameters (replicated, in their saved dtype).
        groups: Each parameter group's names, in DeepSpeed's order.
        counters: ``global_steps``, ``global_samples``, ``skipped_steps`` as saved.
        ds_version: The DeepSpeed version that wrote it.
    """

    layout: str
    dp_world_size: int
    masters: dict[str, torch.Tensor]
    moments: dict[str, dict[str, torch.Tensor]]
    steps: tuple[float, ...]
    extra: dict[str, torch.Tensor] = field(default_factory=dict)
    groups: tuple[tuple[str, ...], ...] = ()
    counters: dict[str, int] = field(default_factory=dict)
    ds_version: str = ""


def resolve_deepspeed_tag(ds_dir: str | os.PathLike[str], tag: str | None = None) -> Path:
    """The tag directory to read: ``ds_dir`` itself when it holds model states, else the tag
    ``latest`` (or ``latest_universal``) names, else ``ds_dir/tag``.

    Raises:
        CheckpointError: No such directory, or no tag given and no ``latest`` file.
    """
    root = Path(ds_dir)
    if not root.is_dir():
        raise CheckpointError(f"{root}: no such DeepSpeed checkpoint directory")
    if tag is None and (any(root.glob("*model_states.pt")) or (root / "zero").is_dir()):
        return root
    if tag is None:
        for name in ("latest", "latest_universal"):
            if (root / name).is_file():
                tag = (root / name).read_text().strip()
                break
    if tag is None:
        found = sorted(p.name for p in root.iterdir() if p.is_dir())
        raise CheckpointError(
            f"{root}: no 'latest' file and no tag given; pass the tag (directories here: "
            f"{', '.join(found) or 'none'})"
        )
    tag_dir = root / tag
    if not tag_dir.is_dir():
        raise CheckpointError(f"{root}: tag {tag!r} has no directory {tag_dir}")
    return tag_dir


def _model_states(tag_dir: Path) -> dict[str, Any]:
    files = sorted(tag_dir.glob("mp_rank_*_model_states.pt")) or sorted(
        tag_dir.glob("zero_pp_rank_0_mp_rank_*_model_states.pt")
    )
    if not files:
        raise CheckpointError(f"{tag_dir}: no DeepSpeed mp_rank_*_model_states.pt file")
    if len(files) > 1 and "zero_pp_rank" not in files[0].name:
        raise CheckpointError(
            f"{tag_dir}: {len(files)} model-parallel ranks; tensor/pipeline-parallel DeepSpeed "
            "checkpoints are not read (convert with ds_to_universal first)"
        )
    states = load_deepspeed_file(files[0])
    if not isinstance(states, dict) or "module" not in states:
        raise CheckpointError(f"{files[0]}: no 'module' entry; not a DeepSpeed model-states file")
    return states


def _shapes(
    states: Mapping[str, Any], key: str = "param_shapes"
) -> list[dict[str, tuple[int, ...]]]:
    groups = states.get(key) or []
    if isinstance(groups, Mapping):
        groups = [groups]
    return [{str(n): tuple(int(s) for s in shape) for n, shape in g.items()} for g in groups]


def _counters(states: Mapping[str, Any]) -> dict[str, int]:
    return {k: int(states.get(k) or 0) for k in ("global_steps", "global_samples", "skipped_steps")}


def _extra(states: Mapping[str, Any], trained: set[str]) -> dict[str, torch.Tensor]:
    """Buffers and frozen parameters the module state dict holds whole.

    Stage-3 placeholders (empty tensors) and the aliases of shared parameters (``shared_params``:
    stored once, under the first name) are left out.
    """
    module: Mapping[str, torch.Tensor] = states["module"]
    aliases = set(states.get("shared_params") or ())
    return {
        name: tensor.clone()
        for name, tensor in module.items()
        if name not in trained and name not in aliases and tensor.numel() > 0
    }


def _step_of(state: Mapping[str, Any], where: str) -> float:
    if "step" not in state:
        raise CheckpointError(f"{where}: the optimizer state has no 'step'; only Adam is read")
    unknown = sorted(set(state) - {"step", *MOMENTS})
    if unknown:
        raise CheckpointError(
            f"{where}: optimizer state {unknown} is not Adam's ({', '.join(MOMENTS)}, step); "
            "only Adam/AdamW checkpoints are imported"
        )
    return float(state["step"])


def _optim_files(tag_dir: Path) -> list[Path]:
    found: dict[int, Path] = {}
    for path in tag_dir.iterdir():
        match = _RANK_FILE.match(path.name)
        if match and match[3] == "00":
            found[int(match[2])] = path
        elif match:
            raise CheckpointError(
                f"{path}: model-parallel rank {int(match[3])}; tensor/pipeline-parallel "
                "DeepSpeed checkpoints are not read (convert with ds_to_universal first)"
            )
    if sorted(found) != list(range(len(found))):
        raise CheckpointError(
            f"{tag_dir}: optimizer files for data-parallel ranks {sorted(found)}; one is missing"
        )
    return [found[r] for r in range(len(found))]


def read_deepspeed(
    ds_dir: str | os.PathLike[str], tag: str | None = None, *, progress: Progress | None = None
) -> DeepSpeedState:
    """Read a DeepSpeed ZeRO 0-3, bf16 or universal checkpoint into whole fp32 tensors.

    Args:
        ds_dir: A DeepSpeed checkpoint directory (with ``latest``) or a tag directory.
        tag: The tag to read when ``ds_dir`` is the checkpoint directory.
        progress: Called with each file's name as it is read.

    Raises:
        CheckpointError: Missing or damaged files, a file that would need arbitrary unpickling,
            a layout or optimizer this reader does not know (each names the file and why).
    """
    tag_dir = resolve_deepspeed_tag(ds_dir, tag)
    report = progress or (lambda _name: None)
    if (tag_dir / "zero").is_dir():
        return _read_universal(tag_dir, report)
    states = _model_states(tag_dir)
    files = _optim_files(tag_dir)
    if not files:
        return _read_zero0(tag_dir, states)
    parts = []
    for path in files:
        report(path.name)
        loaded = load_deepspeed_file(path)
        if not isinstance(loaded, dict) or "optimizer_state_dict" not in loaded:
            raise CheckpointError(f"{path}: no 'optimizer_state_dict'; not a ZeRO optimizer file")
        parts.append(loaded["optimizer_state_dict"])
    stage = int(parts[0].get("zero_stage", 0))
    if stage == 3:
        return _read_zero3(tag_dir, states, parts, report)
    layout = "bf16" if files[0].name.startswith("bf16_") else f"zero-{stage}"
    return _read_partitioned(states, parts, layout, files)


def _read_zero0(tag_dir: Path, states: Mapping[str, Any]) -> DeepSpeedState:
    optimizer = states.get("optimizer")
    if not isinstance(optimizer, Mapping) or "param_groups" not in optimizer:
        raise CheckpointError(
            f"{tag_dir}: no ZeRO optimizer files and no optimizer state in the model states; "
            "was it saved without the optimizer?"
        )
    module: Mapping[str, torch.Tensor] = states["module"]
    buffers = set(states.get("buffer_names") or ())
    seen: set[tuple[int, int]] = set()
    names = []
    for name, tensor in module.items():
        key = (tensor.untyped_storage().data_ptr(), int(tensor.storage_offset()))
        if name in buffers or key in seen:
            continue  # shared parameters are one optimizer entry, under their first name
        seen.add(key)
        names.append(name)
    indices = [int(i) for g in optimizer["param_groups"] for i in g["params"]]
    if len(indices) != len(names):
        raise CheckpointError(
            f"{tag_dir}: the optimizer has {len(indices)} parameters, the module "
            f"{len(names)}; a stage-0 checkpoint with frozen parameters cannot be matched by "
            "position (convert it with ds_to_universal first)"
        )
    by_index = dict(zip(sorted(indices), names, strict=True))
    masters = {by_index[i]: module[by_index[i]].float().clone() for i in indices}
    moments: dict[str, dict[str, torch.Tensor]] = {m: {} for m in MOMENTS}
    steps = []
    for group in optimizer["param_groups"]:
        group_steps = set()
        for index in group["params"]:
            state = optimizer["state"].get(index, {})
            group_steps.add(_step_of(state, f"{tag_dir} optimizer state {index}"))
            for m in MOMENTS:
                moments[m][by_index[int(index)]] = state[m].float().clone()
        steps.append(_single(group_steps, tag_dir))
    groups = tuple(tuple(by_index[int(i)] for i in g["params"]) for g in optimizer["param_groups"])
    return DeepSpeedState(
        "zero-0",
        int(states.get("dp_world_size") or 1),
        masters,
        moments,
        tuple(steps),
        _extra(states, set(masters)),
        groups,
        _counters(states),
        str(states.get("ds_version")),
    )


def _single(values: set[float], where: Path) -> float:
    if len(values) != 1:
        raise CheckpointError(
            f"{where}: parameters of one group have different Adam steps {values}"
        )
    return values.pop()


def _read_partitioned(
    states: Mapping[str, Any], parts: list[Mapping[str, Any]], layout: str, files: list[Path]
) -> DeepSpeedState:
    shapes = _shapes(states)
    masters: dict[str, torch.Tensor] = {}
    moments: dict[str, dict[str, torch.Tensor]] = {m: {} for m in MOMENTS}
    steps = []
    for g, group_shapes in enumerate(shapes):
        pieces: dict[str, dict[str, list[torch.Tensor]]] = {}
        group_steps = set()
        for path, part in zip(files, parts, strict=True):
            flat = part["single_partition_of_fp32_groups"][g]
            inner = part["base_optimizer_state"]["state"].get(g, {})
            group_steps.add(_step_of(inner, f"{path} group {g}"))
            mappings: Mapping[str, FragmentAddress] = part["param_slice_mappings"][g]
            for name, address in mappings.items():
                span = slice(address.start, address.start + address.numel)
                into = pieces.setdefault(name, {"master": [], **{m: [] for m in MOMENTS}})
                into["master"].append(flat[span])
                for m in MOMENTS:
                    into[m].append(inner[m][span])
        steps.append(_single(group_steps, files[0]))
        for name, shape in group_shapes.items():
            got = pieces.get(name)
            if got is None or sum(t.numel() for t in got["master"]) != math.prod(shape):
                raise CheckpointError(
                    f"{files[0].parent}: the partitions hold "
                    f"{0 if got is None else sum(t.numel() for t in got['master'])} elements of "
                    f"{name}, its shape {shape} has {math.prod(shape)}"
                )
            masters[name] = torch.cat(got["master"]).float().view(shape).clone()
            for m in MOMENTS:
                moments[m][name] = torch.cat(got[m]).float().view(shape).clone()
    return DeepSpeedState(
        layout,
        len(parts),
        masters,
        moments,
        tuple(steps),
        _extra(states, set(masters)),
        tuple(tuple(g) for g in shapes),
        _counters(states),
        str(states.get("ds_version")),
    )


def _read_zero3(
    tag_dir: Path, states: Mapping[str, Any], parts: list[Mapping[str, Any]], report: Progress
) -> DeepSpeedState:
    world = len(parts)
    shapes = _shapes(states)
    flats: list[dict[str, torch.Tensor]] = []
    steps: set[float] = set()
    for rank, part in enumerate(parts):
        inner = part["optimizer_state_dict"]["state"]
        ordered = [inner[k] for k in sorted(inner)]
        for index, state in enumerate(ordered):
            steps.add(_step_of(state, f"{tag_dir} rank {rank} sub-group {index}"))
        flat = {"master": torch.cat([t.reshape(-1) for t in part["fp32_flat_groups"]])}
        for m in MOMENTS:
            flat[m] = torch.cat([s[m].reshape(-1) for s in ordered])
            if flat[m].numel() != flat["master"].numel():
                raise CheckpointError(
                    f"{tag_dir}: rank {rank}'s {m} has {flat[m].numel()} elements, its fp32 "
                    f"partitions {flat['master'].numel()}"
                )
        flats.append(flat)
    masters: dict[str, torch.Tensor] = {}
    moments: dict[str, dict[str, torch.Tensor]] = {m: {} for m in MOMENTS}
    offset = 0
    for name, shape in ((n, s) for g in shapes for n, s in g.items()):
        numel = math.prod(shape)
        width = math.ceil(numel / world)
        for kind, into in (("master", masters), *((m, moments[m]) for m in MOMENTS)):
            cut = [f[kind][offset : offset + width] for f in flats]
            if any(c.numel() != width for c in cut):
                raise CheckpointError(f"{tag_dir}: the ZeRO-3 partitions end inside {name}")
            into[name] = torch.cat(cut)[:numel].float().view(shape).clone()
        offset += width
    frozen = _frozen_zero3(tag_dir, states, world, report)
    extra = {**_extra(states, set(masters) | set(frozen)), **frozen}
    return DeepSpeedState(
        "zero-3",
        world,
        masters,
        moments,
        (_single(steps, tag_dir),) * max(1, len(shapes)),
        extra,
        tuple(tuple(g) for g in shapes),
        _counters(states),
        str(states.get("ds_version")),
    )


def _frozen_zero3(
    tag_dir: Path, states: Mapping[str, Any], world: int, report: Progress
) -> dict[str, torch.Tensor]:
    """Frozen parameters of ZeRO 3: each rank's model states hold its fragment."""
    shapes = {n: s for g in _shapes(states, "frozen_param_shapes") for n, s in g.items()}
    if not shapes:
        return {}
    fragments = []
    for rank in range(world):
        path = next(tag_dir.glob(f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt"), None)
        if path is None:
            raise CheckpointError(f"{tag_dir}: no model states of rank {rank} (frozen parameters)")
        report(path.name)
        fragments.append(load_deepspeed_file(path)["frozen_param_fragments"])
    return {
        n: torch.cat([f[n].reshape(-1) for f in fragments])[: math.prod(s)].view(s).clone()
        for n, s in shapes.items()
    }


def _universal_value(path: Path) -> torch.Tensor:
    loaded = load_deepspeed_file(path)
    tensor = loaded.get("param") if isinstance(loaded, Mapping) else loaded
    if not isinstance(tensor, torch.Tensor):
        raise CheckpointError(f"{path}: holds no tensor ('param' entry) of a universal checkpoint")
    return tensor


def _read_universal(tag_dir: Path, report: Progress) -> DeepSpeedState:
    zero = tag_dir / "zero"
    states = _model_states(tag_dir) if any(tag_dir.glob("mp_rank_*_model_states.pt")) else None
    names = sorted(p.name for p in zero.iterdir() if (p / "fp32.pt").is_file())
    if not names:
        raise CheckpointError(f"{zero}: no <param>/fp32.pt; not a DeepSpeed universal checkpoint")
    shapes = _shapes(states) if states else [dict.fromkeys(names, ())]
    order = [n for g in shapes for n in g if n in names] or names
    masters: dict[str, torch.Tensor] = {}
    moments: dict[str, dict[str, torch.Tensor]] = {m: {} for m in MOMENTS}
    steps = set()
    for name in order:
        report(name)
        masters[name] = _universal_value(zero / name / "fp32.pt").float().clone()
        for m in MOMENTS:
            moments[m][name] = _universal_value(zero / name / f"{m}.pt").float().clone()
        if (zero / name / "step.pt").is_file():
            steps.add(float(_universal_value(zero / name / "step.pt")))
    groups = (
        tuple(tuple(n for n in g if n in masters) for g in shapes) if states else (tuple(order),)
    )
    return DeepSpeedState(
        "universal",
        1,
        masters,
        moments,
        (_single(steps, zero),) * len(groups),
        _extra(states, set(masters)) if states else {},
        groups,
        _counters(states) if states else {},
        str(states.get("ds_version")) if states else "",
    )
