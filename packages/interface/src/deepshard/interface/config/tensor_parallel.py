"""`tensor_parallel`: automatic tensor parallelism (AutoTP) for training."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from deepshard.interface.config._base import ConfigModel, raw_problems_error
from deepshard.interface.config._dtypes import DtypeName, normalize_dtype
from deepshard.interface.config._removed import KERNEL_INJECT_MESSAGE

__all__ = ["TensorParallelConfig", "TpLayerSpecConfig", "TpPartitionConfig", "TpSizeConfig"]


class TpSizeConfig(ConfigModel):
    """`tensor_parallel.tp`: DeepSpeed's inference-style tensor-parallel settings."""

    config_key = "tensor_parallel.tp"

    tp_size: int = Field(1, ge=1)
    """Ranks a model is split across in inference-style TP (training uses ``autotp_size``)."""

    tp_grain_size: int = Field(1, ge=1)
    """Granularity (elements) that MLP / lm_head shards are rounded to."""

    tp_group: None = None
    """Refused when set: DeepShard builds the tensor-parallel groups from the mesh (adjacent
    ranks); DeepSpeed's explicit group object has no DeepShard equivalent."""

    @field_validator("tp_group", mode="before")
    @classmethod
    def _refuse_group(cls, value: object) -> None:
        if value is not None:
            raise ValueError(
                "DeepShard builds the tensor-parallel groups from the mesh (adjacent ranks); "
                "remove tp_group and set tensor_parallel.autotp_size, or pass "
                "initialize(mesh=deepshard.comm.build_mesh(Topology(tp=...)))"
            )
        return None


class TpLayerSpecConfig(ConfigModel):
    """One rule of a custom AutoTP partition: which weights, split how."""

    config_key = "tensor_parallel.partition_config.layer_specs"

    patterns: list[str] = Field(min_length=1)
    """Regular expressions matched against parameter names (``".*\\\\.q_proj\\\\.weight$"``)."""

    partition_type: Literal["column", "row", "skip"] = "column"
    """Split the output features (column), the input features (row), or leave whole (skip)."""

    gather_output: bool = False
    """All-gather a column-parallel output back to full width."""

    grad_allreduce: bool = False
    """All-reduce the gradient of a replicated (skip) weight across TP ranks."""

    shape: list[int] | None = None
    """View the weight as this shape before splitting (fused projections, e.g. ``[2, -1]``)."""

    partition_dim: int | None = None
    """Dimension of ``shape`` to split; None uses the partition type's default."""

    model_types: list[str] | None = None
    """Only apply to these HF ``model_type`` values; None applies to all."""

    @field_validator("partition_type", mode="before")
    @classmethod
    def _lower(cls, value: object) -> object:
        return value.lower() if isinstance(value, str) else value


class TpPartitionConfig(ConfigModel):
    """`tensor_parallel.partition_config`: custom AutoTP rules, optionally on top of presets."""

    config_key = "tensor_parallel.partition_config"

    use_default_specs: bool = True
    """Merge these rules with the preset's (else they replace it)."""

    layer_specs: list[TpLayerSpecConfig] = Field(default_factory=list)
    """Partition rules, first match wins."""

    embedding_partition_dim: int = Field(1, ge=0)
    """Dimension embeddings are split along."""


class TensorParallelConfig(ConfigModel):
    """The `tensor_parallel` section: AutoTP training settings."""

    config_key = "tensor_parallel"

    autotp_size: int = Field(0, ge=0)
    """Tensor-parallel degree for AutoTP training; 0 (or 1) disables it. Sets Topology ``tp``."""

    tp_overlap_comm: bool = False
    """Overlap the TP all-reduce with computation."""

    dtype: DtypeName = "fp16"
    """Dtype the model is converted to by AutoTP (DeepSpeed's default is fp16)."""

    tp: TpSizeConfig = Field(default_factory=TpSizeConfig)
    """Inference-style TP sizes."""

    partition_config: TpPartitionConfig | None = None
    """Custom partition rules; None uses ``preset_model`` or automatic detection."""

    preset_model: str | None = None
    """Built-in rules for a model family ("llama", "qwen2", "mixtral", "phi3", ...)."""

    keep_module_on_host: bool = False
    """Keep loaded checkpoint tensors on the host instead of moving them to the device."""

    replace_with_kernel_inject: bool = Field(False, alias="kernel_inject")
    """Must stay false: DeepSpeed-Inference kernel injection is not carried."""

    @field_validator("dtype", mode="before")
    @classmethod
    def _canonical(cls, value: object) -> object:
        return normalize_dtype(value)

    @field_validator("replace_with_kernel_inject")
    @classmethod
    def _refuse_injection(cls, value: bool) -> bool:
        if value:
            raise raw_problems_error([("", KERNEL_INJECT_MESSAGE)])
        return value

    @property
    def size(self) -> int:
        """The tensor-parallel degree: ``autotp_size`` when above 1, else ``tp.tp_size``."""
        return self.autotp_size if self.autotp_size > 1 else self.tp.tp_size
