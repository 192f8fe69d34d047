"""A model built under `deepshard.zero.Init` is already sharded: the engine checks it fits.

``initialize`` finds the model's `ShardedModule` through its hooks
(`deepshard.zero.sharded_module_of`) and uses it instead of sharding again. Its partitions
cannot be re-cast or moved (``module.to`` sees only empty tensors), so they must already have
the training dtype and device, live on the config's data-parallel group, and follow the
config's stage-3 knobs (the units may be chosen freely). Every mismatch is listed at once.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from deepshard.comm import ParallelDims, resolve_group
from deepshard.interface import DeepShardConfig
from deepshard.interface.errors import ConfigError
from deepshard.zero import ShardedModule, sharded_module_of, stage3_policy

__all__ = ["check_init_built"]


def _policy_problems(sharded: ShardedModule, config: DeepShardConfig) -> list[tuple[str, str]]:
    built = dataclasses.replace(sharded.policy, unit_classes=(), unit_rule=None)
    wanted = stage3_policy(config)
    differ = [
        f.name
        for f in dataclasses.fields(wanted)
        if getattr(built, f.name) != getattr(wanted, f.name)
    ]
    if not differ:
        return []
    return [
        (
            "zero_optimization",
            f"the model was built under deepshard.zero.Init with other stage-3 settings "
            f"({', '.join(differ)}); pass initialize's config to Init(config=...)",
        )
    ]


def check_init_built(
    model: torch.nn.Module,
    config: DeepShardConfig,
    *,
    dims: ParallelDims,
    param_dtype: torch.dtype | None,
    device: torch.device,
) -> ShardedModule | None:
    """The `ShardedModule` of a model built under ``Init`` (``None`` for a plain model).

    Raises:
        ConfigError: The config is not at stage 3, or the partitions' dtype, device, group or
            stage-3 settings are not the config's.
    """
    sharded = sharded_module_of(model)
    if sharded is None:
        return None
    stage = config.zero_optimization.stage
    if stage != 3:
        raise ConfigError.from_problems(
            [
                (
                    "zero_optimization.stage",
                    f"{stage}, but the model was built partitioned under deepshard.zero.Init "
                    "(ZeRO stage 3): set stage 3, or build the model without Init",
                )
            ]
        )
    problems = _policy_problems(sharded, config)
    # the gathered buffers say where training runs: an offloaded partition's home is the host
    parts = [u.buffer for u in sharded.units if u.plan.params]
    dtypes = sorted({str(p.dtype) for p in parts})
    if param_dtype is not None and dtypes and dtypes != [str(param_dtype)]:
        problems.append(
            (
                "Init(dtype=)",
                f"the partitions are {', '.join(dtypes)} but the config trains in "
                f"{param_dtype}; build the model under Init(config=...) or "
                f"Init(dtype={param_dtype})",
            )
        )
    devices = sorted({str(p.device) for p in parts})
    if devices and devices != [str(device)]:
        problems.append(
            (
                "Init(remote_device=)",
                f"the gathered parameters are on {', '.join(devices)} but training runs on "
                f"{device}; build on the training device (offload_param keeps the partitions "
                "on the host or in files by itself)",
            )
        )
    group = dist.get_process_group_ranks(resolve_group(dims.dense_dp))
    if dist.get_process_group_ranks(sharded.group) != group:
        problems.append(
            (
                "Init(mesh=)",
                f"the model is partitioned over other ranks than {group}; pass the "
                "mesh (or ParallelDims) initialize uses",
            )
        )
    if problems:
        raise ConfigError.from_problems(problems)
    return sharded
