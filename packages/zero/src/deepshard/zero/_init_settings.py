"""What a `deepshard.zero.Init` block partitions over and into, read from its arguments.

Every refusal is collected before anything is built. The policy is the one the engine builds
from the same config (`stage3_policy`), so ``initialize`` can use the model built under ``Init``
as it is; the dtype follows the config's precision sections when ``dtype`` is not given, as
DeepSpeed's ``zero.Init`` does.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from deepshard.accelerators import get_accelerator
from deepshard.comm import ParallelDims, resolve_group
from deepshard.interface import DeepShardConfig, Topology
from deepshard.interface.errors import ConfigError
from deepshard.zero._param_offload import ParamOffload
from deepshard.zero._policy import ZeroPolicy
from deepshard.zero.reduction import GradientReduction, torch_dtype

__all__ = ["InitSettings", "resolve_init_settings", "stage3_policy", "zero_policy"]

ConfigSource = DeepShardConfig | dict[str, Any] | str | Path


@dataclass(frozen=True)
class InitSettings:
    """Where an `Init` block's partitions live and how its models are cut.

    Attributes:
        group: The data-parallel group partitions are cut over (``dense_dp``).
        topology: The mesh's layout, for the parameters' placements.
        dtype: Floating parameters are cast to it while partitioned; ``None`` keeps theirs.
        device: Where the partitions live.
        policy: Units and stage-3 knobs of the sharded models.
        slice_files: NVMe parameter offload: the slices are kept in files under its
            ``nvme_path`` while the block is open (``None``: in memory on ``device``).
    """

    group: dist.ProcessGroup
    topology: Topology
    dtype: torch.dtype | None
    device: torch.device
    policy: ZeroPolicy
    slice_files: ParamOffload | None = None


def zero_policy(config: DeepShardConfig) -> ZeroPolicy:
    """The `ZeroPolicy` of a whole config, at its ``zero_optimization.stage``: the section, the
    reduction settings (``gradient_allreduce_op``, pre-division, ``communication_data_type``),
    ``data_types.grad_accum_dtype`` and the ``aio`` section of NVMe parameter offload (what the
    engine shards with at every stage)."""
    return ZeroPolicy.from_config(
        config.zero_optimization,
        reduction=GradientReduction.from_names(
            op=config.gradient_allreduce_op,
            prescale=config.prescale_gradients,
            predivide_factor=config.gradient_predivide_factor,
            dtype=config.communication_data_type,
        ),
        grad_accum_dtype=torch_dtype(
            config.data_types.grad_accum_dtype, key="data_types.grad_accum_dtype"
        ),
        aio=config.aio,
    )


def stage3_policy(config: DeepShardConfig) -> ZeroPolicy:
    """`zero_policy` at stage 3 whatever the section's stage (`Init` partitions at stage 3)."""
    return replace(zero_policy(config), stage=3)


def _load(config: ConfigSource | None) -> DeepShardConfig | None:
    if config is None or isinstance(config, DeepShardConfig):
        return config
    if isinstance(config, dict):
        return DeepShardConfig.from_dict(config)
    if isinstance(config, (str, Path)):
        return DeepShardConfig.from_file(config)
    raise ConfigError(
        f"Init(config=): expected a path, a dict or a DeepShardConfig, got {type(config).__name__}"
    )


def _config_dtype(config: DeepShardConfig) -> torch.dtype | None:
    if config.fp16.enabled:
        return torch.float16
    if config.bf16.enabled:
        return torch.bfloat16
    return torch_dtype(config.data_types.param_dtype, key="data_types.param_dtype")


def _problems(config: DeepShardConfig | None, remote_device: object) -> list[tuple[str, str]]:
    problems = []
    if remote_device not in (None, "cpu", "nvme"):
        problems.append(("Init(remote_device=)", f"{remote_device!r}: use None, 'cpu' or 'nvme'"))
    if config is not None and config.zero_optimization.stage != 3:
        problems.append(
            (
                "zero_optimization.stage",
                f"{config.zero_optimization.stage}, but Init builds ZeRO stage-3 models: "
                "set 3 (or build the model without Init)",
            )
        )
    return problems


def _slice_files(policy: ZeroPolicy, remote_device: str | None) -> ParamOffload | None:
    """Where NVMe slices go: the policy's ``offload_param`` with ``device: nvme``, unless
    ``remote_device`` asks for another place (as DeepSpeed, which defaults it to that device).

    Raises:
        ConfigError: ``remote_device="nvme"`` without an NVMe ``offload_param``.
    """
    offload = policy.param_offload
    nvme = offload if offload is not None and offload.device == "nvme" else None
    if remote_device == "nvme" and nvme is None:
        raise ConfigError.from_problems(
            [
                (
                    "Init(remote_device=)",
                    "'nvme' keeps the slices in files under zero_optimization.offload_param."
                    "nvme_path, but the config (or policy) has no offload_param with device "
                    "'nvme'; add {'device': 'nvme', 'nvme_path': ...} or use None or 'cpu'",
                )
            ]
        )
    return nvme if remote_device in (None, "nvme") else None


def _dims(mesh: DeviceMesh | ParallelDims | None, config: DeepShardConfig | None) -> ParallelDims:
    if isinstance(mesh, ParallelDims):
        return mesh
    if isinstance(mesh, DeviceMesh):
        return ParallelDims.from_mesh(mesh)
    if mesh is not None:
        raise ConfigError(
            f"Init(mesh=): expected a DeviceMesh or a deepshard.comm.ParallelDims, got "
            f"{type(mesh).__name__}"
        )
    if not dist.is_available() or not dist.is_initialized():
        raise ConfigError(
            "Init(mesh=None) needs a distributed world: pass mesh= (deepshard.comm.build_mesh) "
            "or join the world first (deepshard.comm.init_distributed)"
        )
    world = dist.get_world_size()
    return ParallelDims.build(config.topology(world) if config else Topology(dp=world))


def resolve_init_settings(
    config: ConfigSource | None,
    mesh: DeviceMesh | ParallelDims | None,
    dtype: torch.dtype | None,
    remote_device: str | None,
    policy: ZeroPolicy | None,
) -> InitSettings:
    """Check `Init`'s arguments and read what it needs from them.

    Raises:
        ConfigError: A bad ``remote_device`` (``"nvme"`` without an NVMe ``offload_param``),
            a config that is not stage 3, no mesh and no distributed world, or an argument of
            the wrong type. Every problem is listed at once.
    """
    loaded = _load(config)
    problems = _problems(loaded, remote_device)
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        problems.append(("Init(dtype=)", f"{dtype!r}: use a floating torch.dtype or None"))
    if problems:
        raise ConfigError.from_problems(problems)
    if policy is None:
        policy = stage3_policy(loaded) if loaded is not None else ZeroPolicy()
    files = _slice_files(policy, remote_device)
    dims = _dims(mesh, loaded)
    offload = loaded.zero_optimization.offload_param if loaded is not None else None
    if remote_device is None and offload is not None and offload.device == "cpu":
        remote_device = "cpu"
    device_type = dims.mesh.device_type
    if remote_device == "cpu" or device_type == "cpu":
        device = torch.device("cpu")
    else:
        device = get_accelerator(device_type).current_device()
    if dtype is None and loaded is not None:
        dtype = _config_dtype(loaded)
    group = resolve_group(dims.dense_dp)
    return InitSettings(group, dims.topology, dtype, device, policy, slice_files=files)
