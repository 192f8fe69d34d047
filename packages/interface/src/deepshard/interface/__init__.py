"""Typed contracts every DeepShard package shares: config, topology, protocols and errors.

Importing this package is cheap and never imports torch.
"""

from deepshard.interface.accelerator import Accelerator
from deepshard.interface.config import BatchSizes, DeepShardConfig, resolve_batch_sizes
from deepshard.interface.errors import (
    CheckpointError,
    CommError,
    ConfigError,
    DeepShardError,
    LaunchError,
    PartialLoadError,
    TopologyError,
)
from deepshard.interface.expert_transport import ExpertTransport
from deepshard.interface.model_parallel import ModelParallelizer, ParallelizedModel
from deepshard.interface.params import FullGradientPath, ParamShapes
from deepshard.interface.partitioned_params import PartitionedParams
from deepshard.interface.placement import (
    AxisPlacement,
    FlatShard,
    ParamPlacement,
    PlacementRegistry,
    Replicate,
    Shard,
)
from deepshard.interface.shard_map import ShardMap, ShardPiece
from deepshard.interface.topology import Topology

__all__ = [
    "Accelerator",
    "AxisPlacement",
    "BatchSizes",
    "CheckpointError",
    "CommError",
    "ConfigError",
    "DeepShardConfig",
    "DeepShardError",
    "ExpertTransport",
    "FlatShard",
    "FullGradientPath",
    "LaunchError",
    "ModelParallelizer",
    "ParallelizedModel",
    "ParamPlacement",
    "ParamShapes",
    "PartialLoadError",
    "PartitionedParams",
    "PlacementRegistry",
    "Replicate",
    "Shard",
    "ShardMap",
    "ShardPiece",
    "Topology",
    "TopologyError",
    "resolve_batch_sizes",
]
