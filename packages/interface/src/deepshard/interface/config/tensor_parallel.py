"""`tensor_parallel`: automatic tensor parallelism (AutoTP) for training."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from deepshard.interface.config._base import ConfigModel, must_stay_false, raw_problems_error
from deepshard.interface.config._dtypes import DtypeName, normalize_dtype
from deepshard.interface.config._removed import KERNEL_INJECT_MESSAGE

__all__ = ["TensorParallelConfig", "TpLayerSpecConfig", "TpPartitionConfig", "TpSizeConfig"]


class TpSizeConfig(ConfigModel):
    """`tensor_parallel.tp`: DeepSpeed's inference-style tensor-parallel settings."""

    config_key = "tensor_parallel.tp"
    drops_auto = True

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

    shape: list[int | list[int]] | None = None
    """The weight's logical shape, one entry per dimension (``-1``: inferred). At the split
    dimension, an integer ``n`` says it is made of ``n`` equal sub-parameters (``[2, -1]`` for a
    fused gate_up) and a list gives unequal ones (``[[q, k, v], -1]`` for a GQA fused QKV); each
    sub-parameter is split on its own."""

    partition_dim: int | None = Field(None, ge=0)
    """Dimension of ``shape`` to split; None uses the partition type's default (0 for column,
    1 for row)."""

    model_types: list[str] | None = None
    """Only apply to these HF ``model_type`` values; None applies to all."""

    @field_validator("partition_type", mode="before")
    @classmethod
    def _lower(cls, value: object) -> object:
        return value.lower() if isinstance(value, str) else value

    @model_validator(mode="after")
    def _check_shape(self) -> TpLayerSpecConfig:
        if self.shape is None:
            return self
        split_dim = self.split_dim
        problems: list[tuple[str, str]] = []
        if split_dim >= len(self.shape):
            problems.append(
                ("partition_dim", f"{split_dim} is out of range for shape {self.shape}")
            )
        for dim, entry in enumerate(self.shape):
            if isinstance(entry, list):
                if dim != split_dim:
                    problems.append(
                        (
                            "shape",
                            f"a list of sub-parameter sizes belongs at the split "
                            f"dimension {split_dim}, not at dimension {dim}",
                        )
                    )
                elif not entry or any(size <= 0 for size in entry):
                    problems.append(("shape", f"sub-parameter sizes {entry} must be positive"))
            elif entry == 0 or entry < -1:
                problems.append(("shape", f"dimension {dim} is {entry}: use a positive size or -1"))
        if problems:
            raise raw_problems_error(problems)
        return self

    @property
    def split_dim(self) -> int:
        """The dimension split: ``partition_dim``, else 0 for column and 1 for row/skip."""
        if self.partition_dim is not None:
            return self.partition_dim
        return 0 if self.partition_type == "column" else 1


class TpPartitionConfig(ConfigModel):
    """`tensor_parallel.partition_config`: custom AutoTP rules, optionally on top of presets."""

    config_key = "tensor_parallel.partition_config"

    use_default_specs: bool = True
    """Merge these rules with the preset's (else they replace it)."""

    layer_specs: list[TpLayerSpecConfig] = Field(default_factory=list)
    """Partition rules, first match wins."""

    embedding_partition_dim: int = Field(1, ge=0)
    """Accepted for DeepSpeed configs, which do not act on it either: AutoTP splits an embedding
    by vocabulary (dim 0 of its weight)."""

    strict_mode: bool = False
    """Refuse a model with a Linear that no layer spec matches (instead of leaving it whole)."""

    lm_head_patterns: list[str] = Field(default_factory=lambda: ["lm_head", "embed_out"])
    """Names (last component of the module name) of the output projection: planned column
    with ``gather_output`` in training, kept replicated when tied to the input embedding."""


class TensorParallelConfig(ConfigModel):
    """The `tensor_parallel` section: AutoTP training settings."""

    config_key = "tensor_parallel"
    drops_auto = True

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

    _refuse_injection = must_stay_false("replace_with_kernel_inject", KERNEL_INJECT_MESSAGE)

    @property
    def size(self) -> int:
        """The tensor-parallel degree: ``autotp_size`` when above 1, else ``tp.tp_size``."""
        return self.autotp_size if self.autotp_size > 1 else self.tp.tp_size
