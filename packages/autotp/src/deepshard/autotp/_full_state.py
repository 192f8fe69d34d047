"""Whole (unsharded) weights in and out of a tensor-parallel model.

`load_full_state_dict` fills a parallelized model from a full state dict or safetensors files:
every entry of the model's own ``state_dict`` is loaded (parameters and persistent buffers of
every module type, norm variants included, so none is silently left at its initial value), a
sharded one as this rank's pieces only. From safetensors, each rank reads just those pieces
(``safe_open(...).get_slice``), never the whole tensor. `save_full_state_dict` is the
reverse: it all-gathers every sharded entry over TP and returns whole tensors, ready for
export (``save_pretrained``, safetensors).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator, Mapping
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from torch import nn

from deepshard.autotp._functions import all_gather_pieces, local_pieces
from deepshard.autotp._parallelize import STATE_ATTRIBUTE, TPModelState
from deepshard.autotp._placements import sharded_parameters
from deepshard.interface.errors import CheckpointError

__all__ = ["load_full_state_dict", "save_full_state_dict"]

Reader = Callable[[str, int, tuple[tuple[int, int], ...] | None], torch.Tensor]
"""``(name, dim, offsets)`` → the whole tensor (``offsets`` None) or those pieces along dim."""


def _splits(model: nn.Module) -> dict[str, tuple[int, tuple[tuple[int, int], ...], Any]]:
    """Sharded state-dict entries: name → (dim, this rank's offsets, every rank's offsets)."""
    state = vars(model).get(STATE_ATTRIBUTE)
    if not isinstance(state, TPModelState):
        return {}
    found = {}
    for layer in state.plan.layers:
        for local_name, dim in sharded_parameters(layer):
            name = f"{layer.module}.{local_name}"
            if name in state.shard_maps:
                pieces = tuple(layer.offsets(r) for r in range(state.tp.size))
                found[name] = (dim, pieces[state.tp.rank], pieces)
    return found


def _unique_entries(model: nn.Module) -> Iterator[tuple[str, torch.Tensor, list[str]]]:
    """Each distinct tensor of the state dict once, with every name it goes by (tied weights)."""
    seen: dict[int, tuple[str, torch.Tensor, list[str]]] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        key = id(tensor)
        if key in seen:
            seen[key][2].append(name)
        else:
            seen[key] = (name, tensor, [name])
    yield from seen.values()


def _mapping_reader(state_dict: Mapping[str, torch.Tensor]) -> tuple[Reader, set[str]]:
    def read(name: str, dim: int, offsets: tuple[tuple[int, int], ...] | None) -> torch.Tensor:
        full = state_dict[name]
        return full if offsets is None else local_pieces(full, offsets, dim)

    return read, set(state_dict)


def _safetensors_files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [path / file for file in sorted(set(weight_map.values()))]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(
            f"{path} holds no *.safetensors file; pass a safetensors file, a folder written "
            "by save_pretrained, or a state dict"
        )
    return files


def _file_reader(path: Path, stack: ExitStack) -> tuple[Reader, set[str]]:
    from safetensors import safe_open

    where: dict[str, Any] = {}
    for file in _safetensors_files(path):
        handle = stack.enter_context(safe_open(str(file), framework="pt"))
        where.update(dict.fromkeys(handle.keys(), handle))

    def read(name: str, dim: int, offsets: tuple[tuple[int, int], ...] | None) -> torch.Tensor:
        handle = where[name]
        if offsets is None:
            return handle.get_tensor(name)  # type: ignore[no-any-return]
        tensor_slice = handle.get_slice(name)
        lead = (slice(None),) * dim
        parts = [tensor_slice[(*lead, slice(start, start + n))] for start, n in offsets]
        return torch.cat(parts, dim=dim)

    return read, set(where)


def _load_one(
    tensor: torch.Tensor, value: torch.Tensor, name: str, source: str
) -> None:
    if tuple(value.shape) != tuple(tensor.shape):
        raise CheckpointError(
            f"{name!r} in {source} has shape {tuple(value.shape)} but this rank's "
            f"{'shard' if value.ndim else 'tensor'} is {tuple(tensor.shape)}; the weights are "
            "for a different model config"
        )
    with torch.no_grad():
        tensor.copy_(value.to(dtype=tensor.dtype, device=tensor.device))


def load_full_state_dict(
    model: nn.Module, source: Mapping[str, torch.Tensor] | str | os.PathLike[str]
) -> list[str]:
    """Load whole weights into a (parallelized or plain) model, each rank taking its slices.

    Args:
        model: The model, after ``parallelize`` (a plain model loads everything whole).
        source: A full state dict; or a ``.safetensors`` file, or a folder of them (with or
            without ``model.safetensors.index.json``), as ``save_pretrained`` writes.

    Returns:
        The names in ``source`` that the model has no entry for (ignored).

    Raises:
        CheckpointError: An entry of the model is missing from ``source`` or has the wrong
            shape (the message names it).
    """
    splits = _splits(model)
    with ExitStack() as stack:
        if isinstance(source, Mapping):
            read, available, where = *_mapping_reader(source), "the state dict"
        else:
            read, available = _file_reader(Path(source), stack)
            where = str(source)
        used: set[str] = set()
        for name, tensor, aliases in _unique_entries(model):
            key = next((alias for alias in aliases if alias in available), None)
            if key is None:
                raise CheckpointError(
                    f"{name!r} is missing from {where}; every parameter and persistent buffer "
                    "must be there (check that the weights are for this model class)"
                )
            used.update(a for a in aliases if a in available)
            dim, offsets, _ = splits.get(key, (0, None, None))
            _load_one(tensor, read(key, dim, offsets), key, where)
        return sorted(available - used)


def save_full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's whole state dict: sharded entries all-gathered over TP (call on every rank).

    Returns:
        Name → whole tensor (detached, on the CPU), in ``state_dict`` order, on every rank.
    """
    splits = _splits(model)
    state = vars(model).get(STATE_ATTRIBUTE)
    full: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        if name in splits and isinstance(state, TPModelState):
            dim, _, pieces = splits[name]
            moved = tensor.detach().movedim(dim, -1).contiguous()
            whole = all_gather_pieces(moved, pieces, state.tp.rank, state.tp.group)
            tensor = whole.movedim(-1, dim)
        full[name] = tensor.detach().to("cpu").clone()
    return full
