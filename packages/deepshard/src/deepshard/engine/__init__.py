"""DeepShard's user entry point: ``import deepshard.engine as ds``.

``ds.initialize(model, config)`` returns ``(engine, optimizer, dataloader, lr_scheduler)``: the
engine trains the model with ZeRO stage 0, 1 or 2 in fp32, bf16 or fp16 (``engine(batch)``,
``engine.backward(loss)``, ``engine.step()``). A DeepSpeed script runs with its import line
changed to ``import deepshard.engine as deepspeed``: `add_config_arguments` adds its
``--deepspeed_config`` flag, ``initialize(args=..., model=..., ...)`` takes DeepSpeed's keywords,
`RepeatingLoader` is DeepSpeed's endless loader and ``zero`` is `deepshard.zero`
(``deepspeed.zero.Init`` / ``GatheredParameters`` keep working). The module also gathers the
foundation a training script starts from: the typed config, the topology, distributed
start-up, the mesh and the accelerator.
"""

from __future__ import annotations

from importlib.metadata import version as _dist_version

import deepshard.zero as zero
from deepshard.accelerators import get_accelerator
from deepshard.comm import ParallelDims, build_mesh, init_distributed
from deepshard.engine._arguments import add_config_arguments
from deepshard.engine._dataloader import RepeatingLoader
from deepshard.engine._engine import DeepShardEngine, EngineParts
from deepshard.engine._inference import AutoTPParallelizer, init_inference
from deepshard.engine._initialize import InitializeResult, initialize
from deepshard.engine._reporting import TensorBytes
from deepshard.engine.loss_scaler import (
    DynamicLossScaler,
    LossScaler,
    StaticLossScaler,
    build_loss_scaler,
)
from deepshard.interface import (
    CheckpointError,
    CommError,
    ConfigError,
    DeepShardConfig,
    DeepShardError,
    LaunchError,
    Topology,
    TopologyError,
)

__version__ = _dist_version("deepshard")

__all__ = [
    "AutoTPParallelizer",
    "CheckpointError",
    "CommError",
    "ConfigError",
    "DeepShardConfig",
    "DeepShardEngine",
    "DeepShardError",
    "DynamicLossScaler",
    "EngineParts",
    "InitializeResult",
    "LaunchError",
    "LossScaler",
    "ParallelDims",
    "RepeatingLoader",
    "StaticLossScaler",
    "TensorBytes",
    "Topology",
    "TopologyError",
    "__version__",
    "add_config_arguments",
    "build_loss_scaler",
    "build_mesh",
    "get_accelerator",
    "init_distributed",
    "init_inference",
    "initialize",
    "zero",
]
