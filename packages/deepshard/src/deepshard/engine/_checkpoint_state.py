"""What an engine checkpoint holds, by key, and how it maps onto the engine's live tensors.

Keys, independent of the ZeRO stage, bucket sizes and offload that wrote them:

* ``module/<name>``: the model's state dict. A trained parameter is its fp32 master (ZeRO's
  ``master`` shard, sharded as ZeRO holds it); a frozen parameter or buffer at stages 0-2 is
  replicated; a stage-3 frozen parameter is its partition. Tied parameters are stored once,
  under their first name.
* ``optimizer/<name>/<kind>``: each per-element optimizer state (``exp_avg``...), sharded like
  the master; ``optimizer/param_groups.<g>/<kind>``: scalars (``step``), replicated.
* ``rng/<stream>``: one row per rank (`deepshard.engine._rng_state`).
* ``client_state/...``: the tensors of the caller's ``client_state``.

Everything else (counters, schedule, loss scale, data position, config, topology, the JSON part
of ``client_state``) is JSON under the metadata's ``"engine"`` key. The same functions build the
dict to save and the dict a load fills in place (``like``): ZeRO's `StateShard` tensors are its
live storage where it can be, so most of a load lands where training reads it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from deepshard.checkpoint import ShardedTensor
from deepshard.engine._rng_state import RNG_PREFIX, rng_map
from deepshard.interface.errors import CheckpointError
from deepshard.zero import StateShard, ZeroOptimizer

__all__ = [
    "MODULE",
    "OPTIMIZER",
    "EngineTensors",
    "engine_tensors",
    "module_tensors",
    "rng_tensors",
]

MODULE = "module/"
OPTIMIZER = "optimizer/"
_WEIGHT_KINDS = ("master", "param")


@dataclass(frozen=True)
class EngineTensors:
    """The engine's tensors by checkpoint key, and ZeRO's among them.

    Attributes:
        module: ``module/...`` entries.
        optimizer: ``optimizer/...`` entries.
        zero_keys: Checkpoint key -> `StateShard.key`, for every entry ZeRO holds.
    """

    module: dict[str, torch.Tensor | ShardedTensor]
    optimizer: dict[str, torch.Tensor | ShardedTensor]
    zero_keys: dict[str, str]


def _sharded(entry: StateShard, rank: int) -> ShardedTensor:
    linear = entry.kind in _WEIGHT_KINDS
    return ShardedTensor(entry.tensor, entry.shard_map, rank, linear=linear)


def _zero_entries(
    zero: ZeroOptimizer, exclude_frozen: bool
) -> tuple[dict[str, ShardedTensor], dict[str, ShardedTensor], dict[str, str], set[str]]:
    """ZeRO's module and optimizer entries, their ZeRO keys, and every parameter it holds."""
    # ranks of ZeRO's group; of the dp × tp grid (the world) when its maps span tp
    entries = zero.state_shards()
    rank = zero.partition_group.rank()
    if any("tp" in entry.shard_map.axes for entry in entries):
        rank = torch.distributed.get_rank()
    module: dict[str, ShardedTensor] = {}
    optimizer: dict[str, ShardedTensor] = {}
    keys: dict[str, str] = {}
    names: set[str] = set()
    for entry in entries:
        names.add(entry.name)
        if entry.kind == "param" and not entry.frozen:
            continue  # the master is the weight; the model copy follows it on load
        if entry.kind in _WEIGHT_KINDS:
            if entry.frozen and exclude_frozen:
                continue
            key = f"{MODULE}{entry.name}"
            module[key] = _sharded(entry, rank)
        else:
            key = f"{OPTIMIZER}{entry.key}"
            optimizer[key] = _sharded(entry, rank)
        keys[key] = entry.key
    return module, optimizer, keys, names


def module_tensors(
    module: torch.nn.Module, covered: Iterable[str], exclude_frozen: bool
) -> dict[str, torch.Tensor]:
    """The module's state-dict tensors ZeRO does not hold (replicated), live.

    Args:
        module: The engine's module.
        covered: Names of the parameters ZeRO holds (saved as its shards).
        exclude_frozen: Leave out parameters with ``requires_grad=False``.
    """
    held = set(covered)
    params = dict(module.named_parameters(remove_duplicate=False))
    held_ids = {id(params[name]) for name in held if name in params}
    out: dict[str, torch.Tensor] = {}
    for name, value in module.state_dict(keep_vars=True).items():
        param = params.get(name)
        if name in held or (param is not None and id(param) in held_ids):
            continue  # ZeRO holds it, or it is a tied alias of one ZeRO holds
        if param is not None and exclude_frozen and not param.requires_grad:
            continue
        if isinstance(value, torch.Tensor):
            out[f"{MODULE}{name}"] = value.detach()
    return out


def engine_tensors(
    module: torch.nn.Module, zero: ZeroOptimizer | None, *, exclude_frozen: bool = False
) -> EngineTensors:
    """Every ``module/`` and ``optimizer/`` entry of the engine on this rank."""
    if zero is None:
        return EngineTensors(dict(module_tensors(module, (), exclude_frozen)), {}, {})
    sharded, optimizer, keys, names = _zero_entries(zero, exclude_frozen)
    plain = module_tensors(module, names, exclude_frozen)
    return EngineTensors({**sharded, **plain}, dict(optimizer), keys)


def rng_tensors(
    streams: Mapping[str, torch.Tensor], rank: int, world_size: int
) -> dict[str, ShardedTensor]:
    """This rank's RNG rows as entries of ``(world_size, n)`` tensors."""
    return {
        f"{RNG_PREFIX}{name}": ShardedTensor(row.contiguous(), rng_map(row, world_size), rank)
        for name, row in streams.items()
    }


def saved_shape(meta: Mapping[str, Any], key: str) -> tuple[tuple[int, ...], str] | None:
    """The global shape and dtype name of ``key`` in a checkpoint's metadata, or None."""
    entry = meta.get("tensors", {}).get(key)
    if entry is None:
        return None
    smap = entry["shard_map"]
    return tuple(int(d) for d in smap["global_shape"]), str(smap["dtype"])


def check_loaded(
    wanted: Iterable[str], missing: Iterable[str], *, strict: bool, what: str, fix: str
) -> None:
    """Refuse a load that left ``wanted`` keys unfilled (when ``strict``).

    Raises:
        CheckpointError: Naming up to five missing keys, ``what`` they are and the ``fix``.
    """
    absent = sorted(set(wanted) & set(missing))
    if absent and strict:
        shown = ", ".join(absent[:5]) + (" ..." if len(absent) > 5 else "")
        raise CheckpointError(
            f"the checkpoint lacks {len(absent)} {what} this engine has ({shown}); {fix}"
        )
