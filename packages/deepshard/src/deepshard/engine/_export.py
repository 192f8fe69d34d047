"""``save_16bit_model``: the trained weights as one safetensors file, written by rank 0.

At ZeRO stages 0-2 every rank holds the whole model in its training dtype (only gradients and
optimizer state are partitioned), so nothing has to be gathered: rank 0 copies its module's
``state_dict()`` to the CPU and writes it; the other ranks build nothing and wait at a barrier, so
the file exists on return everywhere. The tensors keep the module's dtypes: 16-bit under ``bf16``
or ``fp16``, fp32 otherwise (DeepSpeed saves the module's state dict as it is, too). At ZeRO
stage 3 the parameters are partitioned and empty between uses: every rank gathers them
(`deepshard.zero.ShardedModule.gathered`) while rank 0 writes, then they are released.

DeepShard never pickles, so the file is safetensors whatever name is asked for. The name rule:

* ``*.safetensors`` is kept;
* DeepSpeed's default ``pytorch_model.bin`` becomes ``model.safetensors``, the name Hugging Face's
  ``from_pretrained`` looks for, so ``save_16bit_model(out_dir)`` followed by
  ``AutoModel.from_pretrained(out_dir)`` works as it does after DeepSpeed;
* another pickle name (``*.bin``, ``*.pt``, ``*.pth``, ``*.ckpt``) keeps its stem with the
  ``.safetensors`` suffix (``weights.pt`` → ``weights.safetensors``);
* any other name is refused, naming the argument and this rule.

Each tensor is copied out of ZeRO's flat buffer (safetensors refuses tensors that share storage),
and tied parameters are written under each of their names, so ``load_state_dict`` finds every key.
"""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path, PurePath

import torch
from safetensors.torch import save_file
from torch.distributed.device_mesh import DeviceMesh

from deepshard.comm import barrier
from deepshard.interface.errors import ConfigError
from deepshard.zero import ShardedModule

__all__ = ["module_state_dict", "safetensors_filename", "save_16bit_model"]

_log = logging.getLogger("deepshard.engine")

_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt")
_RENAMED = {"pytorch_model.bin": "model.safetensors"}
_METADATA = {"format": "pt"}  # what Hugging Face's loaders check for


def safetensors_filename(save_filename: str) -> str:
    """The file name `save_16bit_model` writes for the requested ``save_filename``.

    Raises:
        ConfigError: The name has neither the ``.safetensors`` suffix nor a pickle suffix.
    """
    name = PurePath(save_filename)
    if name.suffix == ".safetensors":
        return save_filename
    if name.name in _RENAMED:
        return str(name.with_name(_RENAMED[name.name]))
    if name.suffix in _PICKLE_SUFFIXES:
        return str(name.with_suffix(".safetensors"))
    raise ConfigError(
        f"save_16bit_model(save_filename={save_filename!r}): DeepShard writes safetensors only; "
        "name the file *.safetensors (a .bin/.pt/.pth/.ckpt name is renamed to .safetensors, "
        "pytorch_model.bin to model.safetensors)"
    )


def module_state_dict(
    module: torch.nn.Module,
    *,
    exclude_frozen_parameters: bool = False,
    sharded: ShardedModule | None = None,
) -> dict[str, torch.Tensor]:
    """The module's state dict, without frozen parameters when asked.

    Live tensors at stages 0-2; at stage 3 (``sharded``) the parameters are gathered — a
    collective every rank of the group must call — and copies of the whole tensors returned
    (the live parameters are empty between uses).
    """
    if sharded is not None:
        with sharded.gathered():
            state = _state(module, exclude_frozen_parameters)
            return {name: t.detach().clone() for name, t in state.items()}
    return _state(module, exclude_frozen_parameters)


def _state(module: torch.nn.Module, exclude_frozen_parameters: bool) -> dict[str, torch.Tensor]:
    state = module.state_dict()
    if exclude_frozen_parameters:
        for name, param in module.named_parameters():
            if not param.requires_grad:
                state.pop(name, None)
    return state


def _cpu_copies(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: t.detach().to("cpu", copy=True).contiguous() for name, t in state.items()}


def save_16bit_model(
    module: torch.nn.Module,
    save_dir: str | Path,
    save_filename: str,
    *,
    world: DeviceMesh,
    exclude_frozen_parameters: bool = False,
    sharded: ShardedModule | None = None,
) -> Path:
    """Writes the module's weights as safetensors from rank 0.

    At ZeRO stage 3 every rank must call it (they gather the partitions together, then wait
    for the file). At stages 0-2 rank 0 holds the whole module and nothing is exchanged, so a
    script may call it on rank 0 only (``if rank == 0: engine.save_16bit_model(d)``, as with
    DeepSpeed); the file is written under a temporary name and renamed, so another rank never
    sees it half written.

    Args:
        module: The trained module (whole on every rank at ZeRO stages 0-2).
        save_dir: The directory; created when missing.
        save_filename: The requested file name (see `safetensors_filename` for the rule).
        world: Every rank as one group (`ParallelDims.world`): its rank 0 writes; at stage 3
            all of it waits for the file.
        exclude_frozen_parameters: Leave out parameters with ``requires_grad=False``.
        sharded: At ZeRO stage 3, the model side: every rank gathers the parameters while
            rank 0 writes them.

    Returns:
        The path of the file (rank 0 has written it; at stage 3 it exists when any rank
        returns).

    Raises:
        ConfigError: The file name is refused (on every rank, before any communication).
    """
    path = Path(save_dir) / safetensors_filename(save_filename)
    whole = sharded.gathered() if sharded is not None else contextlib.nullcontext()
    with whole:
        if world.get_local_rank() == 0:
            if path.name != PurePath(save_filename).name:
                _log.warning("save_16bit_model: writing %s (safetensors, not a pickle)", path)
            path.parent.mkdir(parents=True, exist_ok=True)
            state = _state(module, exclude_frozen_parameters)
            partial = path.with_name(f".{path.name}.partial")
            save_file(_cpu_copies(state), str(partial), metadata=_METADATA)
            os.replace(partial, path)
    if sharded is not None:
        barrier(group=world)
    return path
