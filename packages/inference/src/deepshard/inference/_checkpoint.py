"""Loading a safetensors checkpoint into an unsplit model, tensor by tensor.

A Hugging Face ``save_pretrained(safe_serialization=True)`` folder (one file, or shards listed by
``model.safetensors.index.json``), a single ``.safetensors`` file, or the ``model.safetensors``
that ``save_16bit_model`` writes. Each tensor is opened with ``safetensors.safe_open`` and copied
into the model's own storage before the next is read: the whole file is never in memory and
nothing is unpickled. Split (tensor-parallel) models load through their parallelizer instead.
"""

from __future__ import annotations

import json
from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from deepshard.interface import CheckpointError

__all__ = ["checkpoint_files", "load_checkpoint"]

INDEX_NAME = "model.safetensors.index.json"


def checkpoint_files(path: str | Path) -> list[Path]:
    """The safetensors files a checkpoint path stands for.

    Raises:
        CheckpointError: The path does not exist, or a folder holds no safetensors file.
    """
    root = Path(path)
    if root.is_file():
        return [root]
    if not root.is_dir():
        raise CheckpointError(f"checkpoint {str(root)!r} does not exist; pass a file or folder")
    index = root / INDEX_NAME
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [root / name for name in names]
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise CheckpointError(
            f"checkpoint folder {str(root)!r} holds no .safetensors file; save with "
            "save_pretrained(safe_serialization=True) or save_16bit_model"
        )
    return files


def _targets(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and persistent buffer once (a tied weight under its first name)."""
    targets: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    state = model.state_dict(keep_vars=True)
    for name, tensor in state.items():
        if id(tensor) not in seen:
            seen.add(id(tensor))
            targets[name] = tensor
    return targets


def _aliases(model: nn.Module) -> dict[str, str]:
    """Each state-dict name to the first name of the same tensor (tied weights)."""
    first: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        aliases[name] = first.setdefault(id(tensor), name)
    return aliases


@torch.no_grad()
def load_checkpoint(model: nn.Module, path: str | Path) -> list[str]:
    """Copies every tensor of a safetensors checkpoint into ``model``, one at a time.

    Args:
        model: An unsplit model; tensors are cast to each entry's dtype and device.
        path: A ``.safetensors`` file or a folder of them.

    Returns:
        The checkpoint names the model has no entry for (ignored).

    Raises:
        CheckpointError: A model entry is missing from the checkpoint or has another shape.
    """
    targets, aliases = _targets(model), _aliases(model)
    loaded: set[str] = set()
    unused: list[str] = []
    with ExitStack() as stack:
        for file in checkpoint_files(path):
            handle = stack.enter_context(safe_open(str(file), framework="pt"))
            for key in handle.keys():  # noqa: SIM118 (safe_open handles are not mappings)
                name = aliases.get(key)
                if name is None:
                    unused.append(key)
                    continue
                tensor = handle.get_tensor(key)
                target = targets[name]
                if tuple(tensor.shape) != tuple(target.shape):
                    raise CheckpointError(
                        f"{key!r} has shape {tuple(tensor.shape)} in {str(file)!r} but "
                        f"{tuple(target.shape)} in the model; is the checkpoint for this model?"
                    )
                target.copy_(tensor)
                loaded.add(name)
    missing = sorted(set(targets) - loaded)
    if missing:
        raise CheckpointError(
            f"{missing[0]!r} (and {len(missing) - 1} more) missing from {str(path)!r}; every "
            "parameter and persistent buffer must be there (is it for this model class?)"
        )
    return unused
