"""`elasticity`: batch sizes that stay valid as the number of GPUs changes."""

from __future__ import annotations

from pydantic import Field, PositiveInt, model_validator

from deepshard.interface.config._base import ConfigModel, raw_problems_error

__all__ = ["ElasticityConfig"]


class ElasticityConfig(ConfigModel):
    """The `elasticity` section. When enabled, the engine picks the global and micro batch for
    the actual GPU count from these bounds, and the top-level batch keys must be absent (or
    ``ignore_non_elastic_batch_info`` true)."""

    config_key = "elasticity"

    enabled: bool = False
    """Derive batch sizes from the elastic schedule instead of the top-level batch keys."""

    max_train_batch_size: int = Field(2000, gt=0)
    """Largest acceptable global batch; required when enabled."""

    micro_batch_sizes: list[PositiveInt] = Field(default_factory=lambda: [2, 4, 6])
    """Acceptable per-GPU micro-batches; required when enabled."""

    min_gpus: int = Field(1, ge=1)
    """Fewest GPUs the schedule must support."""

    max_gpus: int = Field(10000, ge=1)
    """Most GPUs the schedule must support."""

    min_time: int = Field(0, ge=0)
    """Minimum minutes a scheduler should keep a given GPU count (informational)."""

    version: float = 0.2
    """Version of the elastic algorithm (0.1 or 0.2)."""

    ignore_non_elastic_batch_info: bool = False
    """Allow (and ignore) the top-level batch keys while elasticity is on."""

    prefer_larger_batch: bool = True
    """Among valid global batches, prefer the largest."""

    model_parallel_size: int = Field(1, ge=1)
    """Model-parallel ranks per replica (elastic version 0.2)."""

    num_gpus_per_node: int = Field(1, ge=1)
    """GPUs per node (elastic version 0.2)."""

    @model_validator(mode="after")
    def _consistent(self) -> ElasticityConfig:
        problems: list[tuple[str, str]] = []
        if self.enabled:
            for key in ("max_train_batch_size", "micro_batch_sizes"):
                if key not in self.model_fields_set:
                    problems.append((key, "required when elasticity is enabled"))
        if self.min_gpus > self.max_gpus:
            problems.append(("min_gpus", f"{self.min_gpus} exceeds max_gpus {self.max_gpus}"))
        if self.version not in (0.1, 0.2):
            problems.append(("version", f"expected 0.1 or 0.2; got {self.version}"))
        if problems:
            raise raw_problems_error(problems)
        return self
