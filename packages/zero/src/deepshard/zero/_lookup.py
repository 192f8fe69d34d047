"""Which ZeRO object owns a parameter, found through the hook objects ZeRO registers on it.

DeepShard patches nothing onto parameters. Instead every parameter ZeRO partitions carries one
of ZeRO's post-accumulate-grad hook objects in ``param._post_accumulate_grad_hooks`` (torch's
own hook table): a `deepshard.zero._sharded.ParamHook` naming its `ShardedModule`, or, while a
`deepshard.zero.Init` block that partitioned it is still open, a
`deepshard.zero._init_slices.SliceHook` naming that block's slice store.
"""

from __future__ import annotations

import torch

from deepshard.interface.errors import ConfigError
from deepshard.zero._init_slices import InitSlices, SliceHook
from deepshard.zero._sharded import ParamHook, ShardedModule

__all__ = ["owner_of", "owner_or_slices"]


def _hooks(tensor: torch.Tensor) -> list[object]:
    table = getattr(tensor, "_post_accumulate_grad_hooks", None)
    return list(table.values()) if table else []


def owner_or_slices(tensor: object, *, argument: str) -> ShardedModule | InitSlices:
    """The `ShardedModule` (or open `Init`'s slice store) that partitioned ``tensor``.

    Args:
        tensor: What the caller passed.
        argument: The argument's name, for the error.

    Raises:
        ConfigError: ``tensor`` is not a tensor, or not partitioned by ZeRO stage 3.
    """
    if not isinstance(tensor, torch.Tensor):
        raise ConfigError(
            f"{argument}: expected a parameter (torch.Tensor), got {type(tensor).__name__}"
        )
    for hook in _hooks(tensor):
        if isinstance(hook, ParamHook) and hook.sharded is not None:
            return hook.sharded
        if isinstance(hook, SliceHook):
            return hook.slices
    raise ConfigError(
        f"{argument}: a tensor of shape {tuple(tensor.shape)} is not a ZeRO stage-3 parameter; "
        "pass parameters of a model partitioned by deepshard.zero.shard, deepshard.zero.Init "
        "or initialize() with zero_optimization.stage 3"
    )


def owner_of(tensor: object, *, argument: str) -> ShardedModule:
    """The `ShardedModule` that partitioned ``tensor``.

    Raises:
        ConfigError: As `owner_or_slices`, or ``tensor`` belongs to a ``deepshard.zero.Init``
            block that is still open.
    """
    owner = owner_or_slices(tensor, argument=argument)
    if isinstance(owner, InitSlices):
        raise ConfigError(
            f"{argument}: this parameter was partitioned by a deepshard.zero.Init block that is "
            "still open; its ShardedModule exists once the with block exits"
        )
    return owner
