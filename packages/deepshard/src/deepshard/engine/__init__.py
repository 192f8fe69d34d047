"""DeepShard's user entry point: ``import deepshard.engine as ds``.

The training engine (``ds.initialize``) lands with the engine issue; until then this module
gathers the foundation a training script starts from, so user code already imports one place:
the typed config, the topology, distributed start-up, the mesh and the accelerator.
"""

from __future__ import annotations

from importlib.metadata import version as _dist_version

from deepshard.accelerators import get_accelerator
from deepshard.comm import build_mesh, init_distributed
from deepshard.interface import (
    CheckpointError,
    ConfigError,
    DeepShardConfig,
    DeepShardError,
    LaunchError,
    Topology,
    TopologyError,
)

__version__ = _dist_version("deepshard")

__all__ = [
    "CheckpointError",
    "ConfigError",
    "DeepShardConfig",
    "DeepShardError",
    "LaunchError",
    "Topology",
    "TopologyError",
    "__version__",
    "build_mesh",
    "get_accelerator",
    "init_distributed",
]
