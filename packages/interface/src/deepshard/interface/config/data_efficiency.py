"""`curriculum_learning` (legacy) and `data_efficiency`: data sampling and routing schedules.

DeepSpeed reads both sections as plain dictionaries and checks keys only when a feature runs;
here each documented key is a typed field. ``curriculum_metrics`` is keyed by metric names the
user chooses, so it is a mapping of name to `CurriculumMetricConfig`.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from deepshard.interface.config._base import ConfigModel, raw_problems_error

__all__ = [
    "CurriculumLearningConfig",
    "CurriculumMetricConfig",
    "CurriculumScheduleConfig",
    "DataEfficiencyConfig",
    "DataRoutingConfig",
    "DataSamplingConfig",
    "DynamicBatchingConfig",
    "LegacyCurriculumConfig",
    "RandomLtdConfig",
    "RandomLtdLrScheduleConfig",
    "RandomLtdScheduleConfig",
    "RandomLtdStepConfig",
]

ScheduleType = Literal["fixed_discrete", "fixed_root", "fixed_linear", "custom"]

_SCHEDULE_KEYS: dict[str, tuple[str, ...]] = {
    "fixed_discrete": ("difficulty", "max_step"),
    "fixed_root": ("total_curriculum_step", "difficulty_step", "root_degree"),
    "fixed_linear": ("total_curriculum_step", "difficulty_step"),
    "custom": (),
}


class CurriculumScheduleConfig(ConfigModel):
    """`schedule_config` of a curriculum: how difficulty grows with the step."""

    total_curriculum_step: int | None = Field(None, ge=1)
    """fixed_root / fixed_linear: steps until the maximum difficulty is reached."""

    difficulty_step: int | None = Field(None, ge=1)
    """fixed_root / fixed_linear: difficulty grows in multiples of this (8 suits tensor cores)."""

    root_degree: int | None = Field(None, ge=1)
    """fixed_root: degree of the root curve (2 = square root)."""

    difficulty: list[int] | None = None
    """fixed_discrete: the difficulty levels, one more than ``max_step``."""

    max_step: list[int] | None = None
    """fixed_discrete: last step of each level but the final one."""


class _Curriculum(ConfigModel):
    """Fields shared by the legacy curriculum and each data-sampling curriculum metric."""

    min_difficulty: int | None = None
    """Starting difficulty (e.g. sequence length); required when enabled."""

    max_difficulty: int | None = None
    """Final difficulty; required when enabled."""

    schedule_type: ScheduleType | None = None
    """How difficulty rises from min to max; required when enabled."""

    schedule_config: CurriculumScheduleConfig = Field(default_factory=CurriculumScheduleConfig)
    """Parameters of the schedule type."""

    def _schedule_problems(self) -> list[tuple[str, str]]:
        problems = [
            (key, "required when the curriculum is enabled")
            for key in ("min_difficulty", "max_difficulty", "schedule_type")
            if getattr(self, key) is None
        ]
        schedule = self.schedule_config
        for key in _SCHEDULE_KEYS.get(self.schedule_type or "custom", ()):
            if getattr(schedule, key) is None:
                problems.append((f"schedule_config.{key}", f"required by {self.schedule_type}"))
        levels, steps = schedule.difficulty, schedule.max_step
        discrete = self.schedule_type == "fixed_discrete" and levels and steps
        if discrete and len(levels or ()) != len(steps or ()) + 1:
            problems.append(("schedule_config.difficulty", "needs one more entry than max_step"))
        return problems


class LegacyCurriculumConfig(_Curriculum):
    """The top-level `curriculum_learning` section (DeepSpeed's first curriculum API)."""

    config_key = "curriculum_learning"

    enabled: bool = False
    """Grow sample difficulty (usually sequence length) over training."""

    curriculum_type: str | None = None
    """What difficulty measures, e.g. "seqlen"."""

    @model_validator(mode="after")
    def _complete(self) -> LegacyCurriculumConfig:
        problems = self._schedule_problems() if self.enabled else []
        if problems:
            raise raw_problems_error(problems)
        return self


class CurriculumMetricConfig(_Curriculum):
    """One metric of `data_efficiency.data_sampling.curriculum_learning.curriculum_metrics`."""

    index_to_sample_path: str | None = None
    """Path of the index mapping difficulty values to samples (from the data analyzer)."""

    index_to_metric_path: str | None = None
    """Path of the index mapping samples to their difficulty value."""

    difficulty_type: Literal["value", "percentile"] = "value"
    """Whether difficulties are raw metric values or percentiles."""

    clustering_type: Literal["single_cluster", "schedule_based"] = "schedule_based"
    """Cluster samples once (single_cluster) or re-cluster as difficulty rises."""

    @model_validator(mode="after")
    def _complete(self) -> CurriculumMetricConfig:
        problems = self._schedule_problems()
        if problems:
            raise raw_problems_error(problems)
        return self


class CurriculumLearningConfig(ConfigModel):
    """`data_efficiency.data_sampling.curriculum_learning`."""

    config_key = "data_efficiency.data_sampling.curriculum_learning"

    enabled: bool = False
    """Sample data by curriculum difficulty."""

    data_cluster_path: str | None = None
    """Directory for the sample clusters built during training."""

    curriculum_metrics: dict[str, CurriculumMetricConfig] = Field(default_factory=dict)
    """Difficulty metrics by user-chosen name (e.g. "seqlen", "vocabularyrarity")."""


class DynamicBatchingConfig(ConfigModel):
    """`data_efficiency.data_sampling.dynamic_batching`: pack variable-length samples by tokens."""

    config_key = "data_efficiency.data_sampling.dynamic_batching"

    enabled: bool = False
    """Form batches by a token budget instead of a fixed sample count."""

    metrics_path: str | None = None
    """Path of the per-sample sequence-length metric."""

    lr_scaling_method: Literal["linear", "sqrt", "none"] = "linear"
    """How the learning rate follows the actual batch size."""

    min_batch_size: int = Field(1, ge=1)
    """Fewest samples per batch."""

    max_batch_size: int | None = Field(None, ge=1)
    """Most samples per batch; None for no cap."""

    sequence_picking_order: Literal["random", "seqlen", "dataloader"] = "dataloader"
    """Order in which samples are packed into batches."""

    max_tokens: int | None = Field(None, ge=1)
    """Token budget per batch; required when enabled."""

    verbose: bool = False
    """Log each batch's size and token count."""

    @model_validator(mode="after")
    def _budget(self) -> DynamicBatchingConfig:
        if self.enabled and self.max_tokens is None:
            raise raw_problems_error([("max_tokens", "required when dynamic batching is enabled")])
        return self


class DataSamplingConfig(ConfigModel):
    """`data_efficiency.data_sampling`."""

    config_key = "data_efficiency.data_sampling"

    enabled: bool = False
    """Use DeepShard's data sampler."""

    num_epochs: int = Field(1000, ge=1)
    """Epochs the sampler can draw from."""

    num_workers: int = Field(0, ge=0)
    """Data-loader worker processes."""

    pin_memory: bool = False
    """Pin loaded batches in host memory."""

    curriculum_learning: CurriculumLearningConfig = Field(default_factory=CurriculumLearningConfig)
    """Curriculum-ordered sampling."""

    dynamic_batching: DynamicBatchingConfig = Field(default_factory=DynamicBatchingConfig)
    """Token-budget batching."""


class RandomLtdStepConfig(ConfigModel):
    """`random_ltd_schedule.schedule_config`."""

    seq_per_step: int = Field(16, ge=1)
    """Tokens added to the kept sequence at each increase."""

    require_steps: int = Field(1, ge=1)
    """Steps between increases."""


class RandomLtdScheduleConfig(ConfigModel):
    """`random_ltd_schedule`: how many tokens the middle layers keep over training."""

    min_value: int = Field(128, ge=1)
    """Tokens kept at the start."""

    max_value: int = Field(2048, ge=1)
    """Tokens kept at the end (the full sequence)."""

    schedule_type: Literal["fixed_linear"] = "fixed_linear"
    """Growth curve of the kept-token count."""

    schedule_config: RandomLtdStepConfig = Field(default_factory=RandomLtdStepConfig)
    """Step parameters of the schedule."""


class RandomLtdLrScheduleConfig(ConfigModel):
    """`layer_token_lr_schedule`: learning-rate schedule by consumed layer-tokens."""

    enabled: bool = False
    """Schedule the learning rate by layer-tokens instead of steps."""

    total_layer_tokens: int | None = Field(None, ge=1)
    """Layer-tokens of the whole run."""

    warmup_type: Literal["linear"] = "linear"
    """Warm-up curve."""

    warmup_layer_tokens: int | None = Field(None, ge=0)
    """Layer-tokens of the warm-up."""


class RandomLtdConfig(ConfigModel):
    """`data_efficiency.data_routing.random_ltd`: random layerwise token dropping."""

    config_key = "data_efficiency.data_routing.random_ltd"

    enabled: bool = False
    """Let the chosen middle layers process a random subset of tokens."""

    model_mask_name: str | None = None
    """Name of the attention-mask argument in the model's layers."""

    model_type: Literal["encoder", "decoder"] = "decoder"
    """Encoder or decoder model (decides the mask shape)."""

    micro_batch_size: int | None = Field(None, ge=1)
    """Micro-batch the layers see (usually the training micro batch)."""

    global_batch_size: int | None = Field(None, ge=1)
    """Global batch (usually the training global batch)."""

    hidden_state_order: Literal["batch_seq_dim", "seq_batch_dim"] = "batch_seq_dim"
    """Layout of the hidden states."""

    random_ltd_layer_num: int | None = Field(None, ge=1)
    """How many layers drop tokens."""

    random_ltd_layer_id: list[int] = Field(default_factory=list)
    """Indices of the layers that drop tokens."""

    total_layer_num: int | None = Field(None, ge=1)
    """Layers in the model."""

    layer_token_lr_schedule: RandomLtdLrScheduleConfig = Field(
        default_factory=RandomLtdLrScheduleConfig
    )
    """Learning-rate schedule by layer-tokens."""

    random_ltd_schedule: RandomLtdScheduleConfig = Field(default_factory=RandomLtdScheduleConfig)
    """Kept-token schedule."""


class DataRoutingConfig(ConfigModel):
    """`data_efficiency.data_routing`."""

    config_key = "data_efficiency.data_routing"

    enabled: bool = False
    """Route tokens through layers selectively."""

    random_ltd: RandomLtdConfig = Field(default_factory=RandomLtdConfig)
    """Random layerwise token dropping."""


class DataEfficiencyConfig(ConfigModel):
    """The `data_efficiency` section: curriculum sampling and token routing."""

    config_key = "data_efficiency"

    enabled: bool = False
    """Turn the data-efficiency library on."""

    seed: int = 1234
    """Seed of the data sampler."""

    data_sampling: DataSamplingConfig = Field(default_factory=DataSamplingConfig)
    """Sampling: curriculum and dynamic batching."""

    data_routing: DataRoutingConfig = Field(default_factory=DataRoutingConfig)
    """Routing: random-LTD."""
