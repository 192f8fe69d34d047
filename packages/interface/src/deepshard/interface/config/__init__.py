"""The DeepShard config schema: one frozen pydantic model per DeepSpeed config section.

`DeepShardConfig` is the whole config; each section model below is what the package that
owns the feature receives (``ZeroConfig`` for ZeRO, ``Fp16Config`` for loss scaling, ...).
"""

from deepshard.interface.config._base import ConfigModel
from deepshard.interface.config.activation_checkpointing import ActivationCheckpointingConfig
from deepshard.interface.config.aio import AioConfig
from deepshard.interface.config.batch import BatchSizes, resolve_batch_sizes
from deepshard.interface.config.checkpoint import (
    CheckpointConfig,
    CheckpointWriterConfig,
    ParallelWriteConfig,
)
from deepshard.interface.config.comms_logger import CommsLoggerConfig
from deepshard.interface.config.data_efficiency import (
    CurriculumLearningConfig,
    CurriculumMetricConfig,
    CurriculumScheduleConfig,
    DataEfficiencyConfig,
    DataRoutingConfig,
    DataSamplingConfig,
    DynamicBatchingConfig,
    LegacyCurriculumConfig,
    RandomLtdConfig,
    RandomLtdLrScheduleConfig,
    RandomLtdScheduleConfig,
    RandomLtdStepConfig,
)
from deepshard.interface.config.deepshard_config import DeepShardConfig
from deepshard.interface.config.elasticity import ElasticityConfig
from deepshard.interface.config.inference import InferenceConfig, InferenceTensorParallelConfig
from deepshard.interface.config.moe import ExpertParallelConfig, MoeConfig
from deepshard.interface.config.monitor import (
    CometConfig,
    CsvMonitorConfig,
    TensorBoardConfig,
    WandbConfig,
)
from deepshard.interface.config.offload import (
    OffloadDevice,
    OffloadOptimizerConfig,
    OffloadParamConfig,
)
from deepshard.interface.config.optimizer import OptimizerConfig, SchedulerConfig
from deepshard.interface.config.precision import (
    AmpConfig,
    Bf16Config,
    DataTypesConfig,
    Fp16Config,
    TorchAutocastConfig,
)
from deepshard.interface.config.profiling import (
    FlopsProfilerConfig,
    ThroughputTimerConfig,
    TimersConfig,
)
from deepshard.interface.config.sequence_parallel import SequenceParallelConfig
from deepshard.interface.config.tensor_parallel import (
    TensorParallelConfig,
    TpLayerSpecConfig,
    TpPartitionConfig,
    TpSizeConfig,
)
from deepshard.interface.config.zero import LeafModuleConfig, LocoConfig, ZeroConfig

__all__ = [
    "ActivationCheckpointingConfig",
    "AioConfig",
    "AmpConfig",
    "BatchSizes",
    "Bf16Config",
    "CheckpointConfig",
    "CheckpointWriterConfig",
    "CometConfig",
    "CommsLoggerConfig",
    "ConfigModel",
    "CsvMonitorConfig",
    "CurriculumLearningConfig",
    "CurriculumMetricConfig",
    "CurriculumScheduleConfig",
    "DataEfficiencyConfig",
    "DataRoutingConfig",
    "DataSamplingConfig",
    "DataTypesConfig",
    "DeepShardConfig",
    "DynamicBatchingConfig",
    "ElasticityConfig",
    "ExpertParallelConfig",
    "FlopsProfilerConfig",
    "Fp16Config",
    "InferenceConfig",
    "InferenceTensorParallelConfig",
    "LeafModuleConfig",
    "LegacyCurriculumConfig",
    "LocoConfig",
    "MoeConfig",
    "OffloadDevice",
    "OffloadOptimizerConfig",
    "OffloadParamConfig",
    "OptimizerConfig",
    "ParallelWriteConfig",
    "RandomLtdConfig",
    "RandomLtdLrScheduleConfig",
    "RandomLtdScheduleConfig",
    "RandomLtdStepConfig",
    "SchedulerConfig",
    "SequenceParallelConfig",
    "TensorBoardConfig",
    "TensorParallelConfig",
    "ThroughputTimerConfig",
    "TimersConfig",
    "TorchAutocastConfig",
    "TpLayerSpecConfig",
    "TpPartitionConfig",
    "TpSizeConfig",
    "WandbConfig",
    "ZeroConfig",
    "resolve_batch_sizes",
]
