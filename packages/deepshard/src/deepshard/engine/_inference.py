"""``deepshard.engine.init_inference``: `deepshard.inference.init_inference` with AutoTP plugged in.

``deepshard.inference`` and ``deepshard.autotp`` sit in the same row and never import each
other; this module (the meta-package, above both) implements the interface's
`ModelParallelizer` with ``deepshard.autotp.parallelize`` and ``load_full_state_dict`` and hands
it to the inference engine.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from deepshard.autotp import load_full_state_dict, parallelize, tp_state
from deepshard.comm import build_mesh
from deepshard.inference import InferenceConfig, InferenceEngine, head_dim_of
from deepshard.inference import init_inference as _init_inference
from deepshard.interface import ConfigError, ParallelizedModel, Topology
from deepshard.interface.config import TensorParallelConfig, TpSizeConfig

__all__ = ["AutoTPParallelizer", "init_inference"]


def split_kv_heads(model: nn.Module) -> int | None:
    """This rank's KV heads, read from the first split ``k_proj``'s local rows (uneven KV-group
    splits and ranks without attention rows included); None without a config or a ``k_proj``."""
    config = getattr(model, "config", None)
    if config is None:
        return None
    head_dim = head_dim_of(config)
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if name.endswith("k_proj") and weight is not None:
            return int(weight.shape[0]) // head_dim
    return None


class AutoTPParallelizer:
    """A `deepshard.interface.ModelParallelizer` backed by ``deepshard.autotp``.

    Args:
        mesh: A mesh with a ``tp`` axis of the configured size; None builds one over the whole
            world (``tp`` adjacent ranks, the rest data-parallel replicas).
    """

    def __init__(self, mesh: DeviceMesh | None = None) -> None:
        self._mesh = mesh

    def _tp_mesh(self, tp_size: int) -> DeviceMesh:
        if self._mesh is not None:
            return self._mesh
        if not dist.is_initialized():
            raise ConfigError(
                f"tensor_parallel.tp_size={tp_size} needs torch.distributed; call "
                "deepshard.engine.init_distributed() first (or launch with deepshard)",
                [("tensor_parallel.tp_size", "no process group is initialised")],
            )
        world = dist.get_world_size()
        if world % tp_size:
            raise ConfigError(
                f"tensor_parallel.tp_size={tp_size} does not divide the world of {world} ranks",
                [("tensor_parallel.tp_size", f"pick a divisor of {world}")],
            )
        return build_mesh(Topology(tp=tp_size, dp=world // tp_size))

    def parallelize(self, model: Any, tp_size: int, tp_grain_size: int) -> ParallelizedModel:
        """Splits ``model`` with AutoTP over ``tp_size`` ranks (see the protocol)."""
        section = TensorParallelConfig(
            autotp_size=tp_size, tp=TpSizeConfig(tp_size=tp_size, tp_grain_size=tp_grain_size)
        )
        split = parallelize(model, self._tp_mesh(tp_size), section)
        group = tp_state(split).tp
        return ParallelizedModel(
            module=split,
            tp_size=group.size,
            tp_rank=group.rank,
            group=group.group,
            kv_heads=split_kv_heads(split),
        )

    def load_checkpoint(self, parallel: ParallelizedModel, path: str) -> list[str]:
        """Loads a whole safetensors checkpoint onto the split layout (see the protocol)."""
        return load_full_state_dict(parallel.module, path)


def init_inference(
    model: nn.Module,
    config: InferenceConfig | Mapping[str, Any] | None = None,
    *,
    mesh: DeviceMesh | None = None,
    **kwargs: Any,
) -> InferenceEngine:
    """DeepSpeed's ``deepspeed.init_inference``: `deepshard.inference.init_inference` with AutoTP.

    Args:
        model: The model, whole, on every rank.
        config: An `InferenceConfig` or a dict of DeepSpeed ``init_inference`` keys.
        mesh: A mesh with a ``tp`` axis; None builds one when ``tp_size`` > 1.
        **kwargs: Config keys; one also in ``config`` must have the same value.

    Returns:
        The engine; under tensor parallelism every rank must call ``generate`` alike.
    """
    return _init_inference(model, config, parallelizer=AutoTPParallelizer(mesh), **kwargs)
