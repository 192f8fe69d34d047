"""The whole DeepShard config: a DeepSpeed JSON config as one frozen, validated model.

Keys and defaults follow DeepSpeed 0.19.7, so a DeepSpeed config parses unchanged where the
feature exists; DeepSpeed features DeepShard does not carry are refused with the alternative
(``_removed.py``). Sections are their own models (``ZeroConfig``, ``Fp16Config``, ...) so that
runtime code receives only the section it needs.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

from pydantic import AliasChoices, Field, ValidationError, field_validator, model_validator

from deepshard.interface.config._base import raw_problems_error
from deepshard.interface.config._cross_checks import cross_section_problems
from deepshard.interface.config._loading import load_config_file
from deepshard.interface.config._removed import ZERO_BOOLEAN_MESSAGE
from deepshard.interface.config._settings import TopLevelSettings
from deepshard.interface.config._translate import config_error_from_validation
from deepshard.interface.config.activation_checkpointing import ActivationCheckpointingConfig
from deepshard.interface.config.aio import AioConfig
from deepshard.interface.config.batch import BatchSizes, resolve_batch_sizes
from deepshard.interface.config.checkpoint import CheckpointConfig
from deepshard.interface.config.comms_logger import CommsLoggerConfig
from deepshard.interface.config.data_efficiency import DataEfficiencyConfig, LegacyCurriculumConfig
from deepshard.interface.config.elasticity import ElasticityConfig
from deepshard.interface.config.moe import ExpertParallelConfig, MoeConfig
from deepshard.interface.config.monitor import (
    CometConfig,
    CsvMonitorConfig,
    TensorBoardConfig,
    WandbConfig,
)
from deepshard.interface.config.optimizer import OptimizerConfig, SchedulerConfig
from deepshard.interface.config.precision import (
    AmpConfig,
    Bf16Config,
    DataTypesConfig,
    Fp16Config,
    TorchAutocastConfig,
)
from deepshard.interface.config.profiling import FlopsProfilerConfig, TimersConfig
from deepshard.interface.config.sequence_parallel import SequenceParallelConfig
from deepshard.interface.config.switched_off import CompileConfig, HybridEngineConfig
from deepshard.interface.config.tensor_parallel import TensorParallelConfig
from deepshard.interface.config.zero import ZeroConfig
from deepshard.interface.errors import ConfigError
from deepshard.interface.topology import Topology

__all__ = ["DeepShardConfig"]


class DeepShardConfig(TopLevelSettings):
    """A whole training config: the top-level settings plus one model per section.

    Build it with `from_dict` or `from_file` (errors become
    `deepshard.interface.ConfigError` with DeepSpeed key paths); `to_dict` gives the
    DeepSpeed key names back.
    """

    optimizer: OptimizerConfig | None = None
    """The optimizer to build; None means the caller passes its own optimizer."""

    scheduler: SchedulerConfig | None = None
    """The LR schedule to build; None means no schedule (or the caller's own)."""

    fp16: Fp16Config = Field(default_factory=Fp16Config)
    """float16 mixed precision and loss scaling."""

    bf16: Bf16Config = Field(
        default_factory=Bf16Config,
        validation_alias=AliasChoices("bf16", "bfloat16"),
        serialization_alias="bf16",
    )
    """bfloat16 mixed precision (`bfloat16` is accepted as the older key)."""

    data_types: DataTypesConfig = Field(default_factory=DataTypesConfig)
    """Gradient-accumulation, parameter and buffer dtypes."""

    torch_autocast: TorchAutocastConfig = Field(default_factory=TorchAutocastConfig)
    """``torch.autocast`` around the forward pass."""

    amp: AmpConfig = Field(default_factory=AmpConfig)
    """apex AMP; accepted only disabled."""

    zero_optimization: ZeroConfig = Field(default_factory=ZeroConfig)
    """ZeRO partitioning, buckets and offload."""

    activation_checkpointing: ActivationCheckpointingConfig = Field(
        default_factory=ActivationCheckpointingConfig
    )
    """Activation recomputation."""

    comms_logger: CommsLoggerConfig = Field(default_factory=CommsLoggerConfig)
    """Per-collective communication logging."""

    comms_watchdog_s: float | None = Field(default=None, ge=0)
    """Seconds a rank may wait in one collective before it reports which ranks have not
    arrived (op, shape, call site) and fails with `CommError`, instead of waiting out the
    process-group timeout (`DEEPSHARD_TIMEOUT`, 10 minutes). None: the `DEEPSHARD_WATCHDOG_S`
    environment variable, else 120; 0 turns the watchdog off. A DeepShard key (DeepSpeed has
    no watchdog); set it above the longest legitimate wait, e.g. one rank's evaluation."""

    flops_profiler: FlopsProfilerConfig = Field(default_factory=FlopsProfilerConfig)
    """FLOPs and latency profile of one step."""

    timers: TimersConfig = Field(default_factory=TimersConfig)
    """Throughput timers."""

    tensorboard: TensorBoardConfig = Field(default_factory=TensorBoardConfig)
    """TensorBoard monitor."""

    wandb: WandbConfig = Field(default_factory=WandbConfig)
    """Weights & Biases monitor."""

    csv_monitor: CsvMonitorConfig = Field(default_factory=CsvMonitorConfig)
    """CSV monitor."""

    comet: CometConfig = Field(default_factory=CometConfig)
    """Comet monitor."""

    tensor_parallel: TensorParallelConfig = Field(default_factory=TensorParallelConfig)
    """AutoTP tensor parallelism."""

    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    """Checkpoint validation, loading and writing."""

    curriculum_learning: LegacyCurriculumConfig = Field(default_factory=LegacyCurriculumConfig)
    """The legacy curriculum-learning API."""

    data_efficiency: DataEfficiencyConfig = Field(default_factory=DataEfficiencyConfig)
    """Curriculum data sampling, dynamic batching and random-LTD routing."""

    elasticity: ElasticityConfig = Field(default_factory=ElasticityConfig)
    """Elastic batch sizing."""

    moe: MoeConfig = Field(default_factory=MoeConfig)
    """DeepShard's MoE section: expert-parallel degree and gating."""

    expert_parallel: ExpertParallelConfig = Field(default_factory=ExpertParallelConfig)
    """DeepSpeed AutoEP for HF MoE models."""

    aio: AioConfig = Field(default_factory=AioConfig)
    """Asynchronous NVMe I/O."""

    sequence_parallel: SequenceParallelConfig = Field(default_factory=SequenceParallelConfig)
    """Ulysses for Hugging Face models (ALST); the degree is ``sequence_parallel_size``."""

    compile: CompileConfig = Field(default_factory=CompileConfig)
    """DeepCompile; accepted only switched off (OpenRLHF writes it so)."""

    hybrid_engine: HybridEngineConfig = Field(default_factory=HybridEngineConfig)
    """The RLHF hybrid engine; accepted only switched off (DeepSpeed-Chat writes it so)."""

    comms_config: dict[str, Any] | None = None
    """Not a DeepSpeed key: LLaMA-Factory writes it, DeepSpeed 0.19.7 reads nothing from it,
    and neither does DeepShard (collectives are logged by ``comms_logger``). Reported when
    given."""

    monitor_config: dict[str, Any] | None = None
    """Not a DeepSpeed key: LLaMA-Factory writes it, DeepSpeed 0.19.7 reads nothing from it,
    and neither does DeepShard (monitors are ``tensorboard``, ``wandb``, ``csv_monitor`` and
    ``comet``). Reported when given."""

    fp8: dict[str, Any] | None = None
    """Not a DeepSpeed key: LLaMA-Factory writes it for FP8 training it sets up itself (through
    Transformer Engine or torchao, outside the engine); DeepSpeed 0.19.7 and DeepShard read
    nothing from it. Reported when given."""

    cuda_visible_devices: Any = None
    """Not a DeepSpeed key (some examples carry it): DeepSpeed 0.19.7 and DeepShard read nothing
    from it; choose devices with ``CUDA_VISIBLE_DEVICES`` or ``ds-launch --include``. Reported
    when given."""

    @model_validator(mode="before")
    @classmethod
    def _drop_comments(cls, data: Any) -> Any:
        """Drops top-level keys starting with ``_``: JSON has no comments, so configs carry
        them as ``"_comment": "..."`` keys (LLaMA-Factory does), which DeepSpeed ignores."""
        if isinstance(data, dict) and any(isinstance(k, str) and k[:1] == "_" for k in data):
            return {k: v for k, v in data.items() if not (isinstance(k, str) and k[:1] == "_")}
        return data

    @field_validator("zero_optimization", mode="before")
    @classmethod
    def _refuse_boolean_zero(cls, value: Any) -> Any:
        if isinstance(value, bool):
            raise raw_problems_error([("", ZERO_BOOLEAN_MESSAGE)])
        return value

    @model_validator(mode="after")
    def _sections_agree(self) -> DeepShardConfig:
        problems = cross_section_problems(self)
        if problems:
            raise raw_problems_error(problems)
        return self

    @classmethod
    def from_dict(
        cls, config: dict[str, Any], *, dp_world_size: int | None = None
    ) -> DeepShardConfig:
        """Validates a DeepSpeed-style config dictionary (the caller's dict is left untouched).

        Args:
            config: The parsed JSON object.
            dp_world_size: Ranks that each read their own micro-batch. When given, the batch
                sizes are reconciled now and stored resolved (skipped under elasticity, whose
                batch sizes the engine derives from the elastic schedule).

        Returns:
            The validated config.

        Raises:
            ConfigError: Every problem found, each with its DeepSpeed key path.
        """
        if not isinstance(config, dict):
            raise ConfigError(
                f"a config must be a dict of DeepSpeed keys, got {type(config).__name__}"
            )
        try:
            parsed = cls.model_validate(copy.deepcopy(config))
        except ValidationError as exc:
            raise config_error_from_validation(exc, cls) from exc
        if dp_world_size is None or parsed.elasticity.enabled:
            return parsed
        sizes = parsed.resolve_batch(dp_world_size)
        return parsed.model_copy(
            update={
                "train_batch_size": sizes.train_batch_size,
                "train_micro_batch_size_per_gpu": sizes.train_micro_batch_size_per_gpu,
                "gradient_accumulation_steps": sizes.gradient_accumulation_steps,
            }
        )

    @classmethod
    def from_file(cls, path: str | Path, *, dp_world_size: int | None = None) -> DeepShardConfig:
        """Reads and validates a JSON (or, with the ``hjson`` extra, HJSON) config file.

        Args:
            path: The config file; ``.hjson`` files are read as HJSON.
            dp_world_size: As in `from_dict`.

        Returns:
            The validated config.

        Raises:
            ConfigError: The file cannot be read or parsed, or the config is invalid.
        """
        return cls.from_dict(load_config_file(path), dp_world_size=dp_world_size)

    def to_dict(self, *, exclude_defaults: bool = False) -> dict[str, Any]:
        """Returns the config as a JSON-ready dict with DeepSpeed key names.

        Args:
            exclude_defaults: Leave out settings equal to their default.

        Returns:
            A dict that `from_dict` turns back into an equal config.
        """
        return self.model_dump(mode="json", by_alias=True, exclude_defaults=exclude_defaults)

    def resolve_batch(self, dp_world_size: int) -> BatchSizes:
        """Reconciles the three batch numbers for a data-parallel world size.

        Args:
            dp_world_size: Ranks that each read their own micro-batch
                (`Topology.batch_world_size`).

        Returns:
            The reconciled batch sizes.

        Raises:
            ConfigError: The numbers are missing, fractional or inconsistent.
        """
        return resolve_batch_sizes(
            self.train_batch_size,
            self.train_micro_batch_size_per_gpu,
            self.gradient_accumulation_steps,
            dp_world_size,
        )

    @property
    def ep_size(self) -> int:
        """The expert-parallel degree, from `moe.ep_size` or an enabled `expert_parallel`."""
        return max(self.moe.ep_size, self.expert_parallel.ep_size)

    def topology(self, world_size: int) -> Topology:
        """Lays ``world_size`` ranks out with this config's tp, sp and ep degrees; dp is the rest.

        Args:
            world_size: Total number of ranks.

        Returns:
            The topology (pp is always 1: DeepShard has no pipeline engine).

        Raises:
            TopologyError: ``world_size`` is not a multiple of tp × ep × sp.
        """
        return Topology.from_world(
            world_size,
            tp=self.tensor_parallel.size,
            ep=self.ep_size,
            sp=self.sequence_parallel_size,
        )
