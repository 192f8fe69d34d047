"""Export: a checkpoint's model weights as consolidated Hugging Face-style safetensors.

The weights are the ``module/<name>`` tensors of an engine checkpoint (the prefix removed), or
every tensor of a checkpoint saved with ``save`` that has no ``module/`` keys. They are
rebuilt whole (`load_state_dict_from_checkpoint`), cast to the chosen dtype, and written as
``model.safetensors``, or, when bigger than ``max_shard_size``, as
``model-00001-of-0000N.safetensors`` files with ``model.safetensors.index.json`` (``metadata``
``total_size`` and the ``weight_map``), the layout ``transformers``' ``from_pretrained`` and
``safetensors.torch.load_file`` read. Files get ``{"format": "pt"}`` metadata, which
``from_pretrained`` requires. Tensors are never split across files (as Hugging Face does).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import save_file

from deepshard.checkpoint._load import load_state_dict_from_checkpoint
from deepshard.interface.errors import CheckpointError

__all__ = ["EXPORT_DTYPES", "export_weights", "parse_size"]

EXPORT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
"""The ``--dtype`` choices and the torch dtype each writes."""

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_UNITS.update({"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40})


def parse_size(text: str | int) -> int:
    """Bytes of ``"5GB"``, ``"500MiB"``, ``"1000"`` (as Hugging Face's ``max_shard_size``).

    Raises:
        CheckpointError: Not a positive size with a known unit.
    """
    if isinstance(text, int) and not isinstance(text, bool):
        value = text
    else:
        match = _SIZE.match(str(text))
        if match is None or (match[2] or "").upper() not in _UNITS:
            raise CheckpointError(
                f"--max-shard-size {text!r}: give a size such as 5GB, 500MB, 2GiB or bytes"
            )
        value = int(float(match[1]) * _UNITS[(match[2] or "").upper()])
    if value < 1:
        raise CheckpointError(f"--max-shard-size {text!r}: must be at least 1 byte")
    return value


def _weights(path: str | os.PathLike[str], tag: str | None) -> dict[str, torch.Tensor]:
    state = load_state_dict_from_checkpoint(path, tag)
    module = {k.removeprefix("module/"): v for k, v in state.items() if k.startswith("module/")}
    if module:
        return module
    if any("/" in key for key in state):
        raise CheckpointError(
            f"{path}: no module/<name> weights and its keys are namespaced "
            f"({sorted(state)[:3]}...); export reads engine checkpoints or a plain state dict"
        )
    return state


def _shards(sizes: list[tuple[str, int]], limit: int) -> list[list[str]]:
    """Greedy, in key order: a new file when the next tensor would pass ``limit``."""
    files: list[list[str]] = [[]]
    used = 0
    for name, size in sizes:
        if files[-1] and used + size > limit:
            files.append([])
            used = 0
        files[-1].append(name)
        used += size
    return files


def export_weights(
    path: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    dtype: str = "fp32",
    max_shard_size: str | int = "5GB",
    tag: str | None = None,
    config: str | os.PathLike[str] | None = None,
    progress: Callable[[str], None] | None = None,
) -> list[Path]:
    """Write the checkpoint's weights to ``out_dir`` as Hugging Face-style safetensors.

    Args:
        path: A checkpoint directory (``latest`` or ``tag``) or a tag directory.
        out_dir: Where to write (created; existing model files are replaced).
        dtype: ``fp32``, ``bf16`` or ``fp16``; floating tensors are cast, others kept.
        max_shard_size: Largest file before the weights are split (``"5GB"``, bytes...).
        tag: The tag when ``path`` is the checkpoint directory.
        config: A ``config.json`` to copy beside the weights (for ``from_pretrained``).
        progress: Called with each file's name as it is written.

    Returns:
        The safetensors files written (and the index, when split).
    """
    if dtype not in EXPORT_DTYPES:
        raise CheckpointError(f"--dtype {dtype!r}: choose one of {', '.join(EXPORT_DTYPES)}")
    limit = parse_size(max_shard_size)
    target = EXPORT_DTYPES[dtype]
    weights = {
        name: (t.to(target) if t.is_floating_point() else t).contiguous()
        for name, t in _weights(path, tag).items()
    }
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for stale in [*out.glob("model*.safetensors"), out / INDEX]:
        stale.unlink(missing_ok=True)
    sizes = [(n, t.numel() * t.element_size()) for n, t in weights.items()]
    groups = _shards(sizes, limit)
    names = (
        [SINGLE]
        if len(groups) == 1
        else [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
    )
    written = []
    for file, members in zip(names, groups, strict=True):
        if progress is not None:
            progress(file)
        save_file({n: weights[n] for n in members}, str(out / file), metadata={"format": "pt"})
        written.append(out / file)
    if len(groups) > 1:
        index = {
            "metadata": {"total_size": sum(s for _, s in sizes)},
            "weight_map": {n: f for f, m in zip(names, groups, strict=True) for n in m},
        }
        (out / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        written.append(out / INDEX)
    if config is not None:
        shutil.copyfile(config, out / "config.json")
    return written
