"""`zero_optimization`: ZeRO stages 1-3, bucket sizes, stage-3 prefetching and offload.

Every key of DeepSpeed 0.19.7's section is accepted with DeepSpeed's default. The stage-3 knobs
are written ``stage3_*`` in JSON; the Python attribute drops the prefix (``prefetch_bucket_size``)
and both spellings are accepted on input. DeepSpeed's old offload switches (``cpu_offload``,
``cpu_offload_param``, ``cpu_offload_use_pin_memory``) are read as DeepSpeed reads them, with a
``FutureWarning`` (see ``_legacy_offload.py``); its removed keys are refused with the replacement
(see ``_removed.py``). ``offload_param`` below stage 3 is dropped with a warning, as DeepSpeed
ignores it there.
"""

from __future__ import annotations

import sys
import warnings
from typing import Any, Literal

from pydantic import AliasChoices, Field, ValidationError, field_validator, model_validator

from deepshard.interface.config._base import ConfigModel, raw_problems_error
from deepshard.interface.config._legacy_offload import translate_legacy_offload
from deepshard.interface.config.offload import OffloadOptimizerConfig, OffloadParamConfig
from deepshard.interface.errors import ConfigError

__all__ = ["LeafModuleConfig", "LocoConfig", "ZeroConfig"]

_HF_MOE_BLOCKS = (
    "transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock",
    "transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock",
    "transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock",
)


def _stage3(python_name: str, default: Any, **bounds: Any) -> Any:
    """A stage-3 field: JSON key ``stage3_<name>``, the bare name accepted too."""
    key = f"stage3_{python_name}"
    return Field(
        default,
        validation_alias=AliasChoices(key, python_name),
        serialization_alias=key,
        **bounds,
    )


def _without_param_offload_below_stage3(data: dict[str, Any]) -> dict[str, Any]:
    """Drops an ``offload_param`` that asks for offload below stage 3, with a warning.

    Below stage 3 every rank holds whole parameters, so there is nothing to offload; DeepSpeed
    0.19.7 hands ``offload_param`` only to its stage-3 engine and ignores it elsewhere without
    a word. Configs generated for stage 2 carry it (DeepSpeed-Chat's ``--offload``), so it is
    ignored here too, but said.
    """
    stage, section = data.get("stage", 0), data.get("offload_param")
    if (
        not isinstance(stage, int)
        or isinstance(stage, bool)
        or stage == 3
        or not isinstance(section, dict)
        or section.get("device") not in ("cpu", "nvme")
    ):
        return data
    try:  # a section with mistakes stays, so that they are reported (DeepSpeed checks it too)
        OffloadParamConfig.model_validate(section)
    except (ValidationError, ConfigError):
        return data
    warnings.warn(
        f"zero_optimization.offload_param has no effect at stage {stage}: parameters are whole "
        "on every rank below stage 3, so they stay on the device (DeepSpeed ignores it there "
        "too); use offload_optimizer to move optimizer state to the CPU, or stage 3 to offload "
        "parameters",
        UserWarning,
        stacklevel=2,
    )
    return {key: value for key, value in data.items() if key != "offload_param"}


class LeafModuleConfig(ConfigModel):
    """Modules ZeRO-3 fetches as one unit (no hooks on their children), e.g. MoE blocks."""

    config_key = "zero_optimization.leaf_module"
    drops_auto = True

    classes: list[str] = Field(default_factory=lambda: list(_HF_MOE_BLOCKS))
    """Fully qualified class names; defaults to the Mixtral/Qwen2-MoE/Qwen3-MoE sparse blocks."""

    names: list[str] = Field(default_factory=list)
    """Module names (as in ``named_modules()``) to treat as leaves."""

    name_suffixes: list[str] = Field(default_factory=list)
    """Module-name suffixes to treat as leaves."""

    @field_validator("classes", "names", "name_suffixes", mode="before")
    @classmethod
    def _one_string_is_a_list(cls, value: object) -> object:
        return [value] if isinstance(value, str) else value

    @field_validator("classes", "names", "name_suffixes")
    @classmethod
    def _dedupe(cls, value: list[str]) -> list[str]:
        return list(dict.fromkeys(value))


class LocoConfig(ConfigModel):
    """`zeropp_loco_param`: LoCo error feedback for ZeRO++ quantized gradients."""

    config_key = "zero_optimization.zeropp_loco_param"

    err_beta: float = Field(0.8, ge=0.0, le=1.0)
    """Moving-average coefficient of the quantization error."""

    reset_T: int = Field(1024, ge=1)
    """Steps after which the error buffer is cleared."""


class ZeroConfig(ConfigModel):
    """The `zero_optimization` section: what ZeRO partitions and how it communicates."""

    config_key = "zero_optimization"
    drops_auto = True

    stage: Literal[0, 1, 2, 3] = 0
    """0 off; 1 partitions optimizer state; 2 also gradients; 3 also parameters."""

    contiguous_gradients: bool = True
    """Copy gradients into one contiguous buffer as they are produced (less fragmentation)."""

    reduce_scatter: bool = True
    """Average gradients with reduce-scatter (each rank gets its shard) instead of all-reduce."""

    reduce_bucket_size: int = Field(500_000_000, gt=0)
    """Elements reduced per bucket."""

    use_multi_rank_bucket_allreduce: bool = True
    """Merge the reduce buckets of several ranks into one all-reduce (helps many small messages)."""

    allgather_partitions: bool = True
    """Gather updated parameters with all-gather (else a series of broadcasts), stages 1-2."""

    allgather_bucket_size: int = Field(500_000_000, ge=0)
    """Elements all-gathered per bucket, stages 1-2."""

    overlap_comm: bool = False
    """Overlap gradient reduction with the backward pass. Default: true for stage 3, false for
    stages 0-2 (DeepSpeed's rule)."""

    compute_grad_norm: bool = True
    """Compute the global gradient norm at each step. False (stage 1-2 only) skips the norm and
    so needs gradient clipping off."""

    load_from_fp32_weights: bool = True
    """Initialise fp32 master weights from the checkpoint's fp32 copy (else from the 16-bit one)."""

    elastic_checkpoint: bool = False
    """Legacy elastic ZeRO checkpoint layout; prefer checkpoint.load_universal."""

    offload_param: OffloadParamConfig | None = None
    """Parameter offload to CPU/NVMe, stage 3 only; None or device "none" keeps them on device."""

    offload_optimizer: OffloadOptimizerConfig | None = None
    """Optimizer-state offload to CPU/NVMe, stages 1-3; None keeps it on device."""

    sub_group_size: int = Field(1_000_000_000, ge=0)
    """Elements per optimizer sub-group stepped at a time (bounds offload/NVMe working memory)."""

    prefetch_bucket_size: int = _stage3("prefetch_bucket_size", 50_000_000, ge=0)
    """Stage 3: parameter elements fetched ahead of use (JSON `stage3_prefetch_bucket_size`)."""

    param_persistence_threshold: int = _stage3("param_persistence_threshold", 100_000, ge=0)
    """Stage 3: parameters with fewer elements stay unpartitioned (less latency-bound traffic)."""

    model_persistence_threshold: int = _stage3("model_persistence_threshold", sys.maxsize, ge=0)
    """Stage 3: cap on the total elements kept unpartitioned by the persistence threshold."""

    max_live_parameters: int = _stage3("max_live_parameters", 1_000_000_000, ge=0)
    """Stage 3: most gathered parameter elements resident per rank before releasing."""

    max_reuse_distance: int = _stage3("max_reuse_distance", 1_000_000_000, ge=0)
    """Stage 3: keep a gathered parameter if it is reused within this many elements of fetches."""

    gather_16bit_weights_on_model_save: bool = Field(
        False,
        validation_alias=AliasChoices(
            "stage3_gather_16bit_weights_on_model_save",
            "stage3_gather_fp16_weights_on_model_save",
            "gather_16bit_weights_on_model_save",
        ),
        serialization_alias="stage3_gather_16bit_weights_on_model_save",
    )
    """Stage 3: gather full 16-bit weights when saving the model (``stage3_gather_fp16_...`` is
    accepted as the older spelling)."""

    module_granularity_threshold: int = _stage3("module_granularity_threshold", 0, ge=0)
    """Stage 3: modules with fewer parameters per descendant than this are fetched as one unit."""

    use_all_reduce_for_fetch_params: bool = _stage3("use_all_reduce_for_fetch_params", False)
    """Stage 3: fetch parameters with all-reduce instead of all-gather (less host-side copying)."""

    allgather_sequential: bool = _stage3("allgather_sequential", False)
    """Stage 3: gather parameters one by one instead of bucketed (lower peak memory)."""

    ignore_unused_parameters: bool = True
    """Tolerate parameters that get no gradient (dynamic networks) instead of failing."""

    round_robin_gradients: bool = False
    """Stages 1-2 with CPU offload: spread gradient copies to host over ranks."""

    parameter_alignment: bool = False
    """Stages 1-2: pad flat buffers so each parameter starts 16-byte aligned."""

    zero_hpz_partition_size: int = Field(1, ge=0)
    """ZeRO++ hierarchical partitioning: ranks in the secondary (intra-node) parameter group;
    1 (or 0) turns hierarchical partitioning off."""

    zero_quantized_weights: bool = False
    """ZeRO++: quantize weights for the stage-3 all-gather."""

    zero_quantized_nontrainable_weights: bool = False
    """ZeRO++: store frozen weights quantized (e.g. the base model under LoRA)."""

    zero_quantized_gradients: bool = False
    """ZeRO++: quantize gradients for the reduction (all-to-all based)."""

    zeropp_loco_param: LocoConfig | None = None
    """ZeRO++ LoCo error feedback for quantized gradients; None disables it."""

    memory_efficient_linear: bool = True
    """Stage 3: a linear layer that does not keep gathered weights for the backward pass."""

    pipeline_loading_checkpoint: bool = False
    """Stage 3: load checkpoints the way the pipeline engine lays them out."""

    override_module_apply: bool = True
    """Stage 3: make ``nn.Module.apply`` gather partitioned parameters first."""

    log_trace_cache_warnings: bool = False
    """Stage 3: log prefetch trace-cache invalidations."""

    enable_sanity_checks: bool = False
    """Extra internal consistency checks (slow; for debugging)."""

    save_muon_momentum_buffer_in_memory: bool = False
    """Stage 3 with Muon and NVMe offload: keep the momentum buffer in memory, not on NVMe."""

    leaf_module: LeafModuleConfig = Field(default_factory=LeafModuleConfig)
    """Stage 3: modules fetched as one unit."""

    @model_validator(mode="before")
    @classmethod
    def _stage_dependent_overlap(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("overlap_comm") is None:
            data = {**data, "overlap_comm": data.get("stage") == 3}
        return data

    @model_validator(mode="before")
    @classmethod
    def _legacy_offload_switches(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        return _without_param_offload_below_stage3(translate_legacy_offload(data))

    @model_validator(mode="after")
    def _stage_requirements(self) -> ZeroConfig:
        problems: list[tuple[str, str]] = []
        if not self.compute_grad_norm and self.stage not in (1, 2):
            problems.append(
                ("compute_grad_norm", f"false needs stage 1 or 2; stage is {self.stage}")
            )
        optimizer = self.offload_optimizer
        if optimizer is not None and optimizer.ratio < 1.0 and self.stage != 3:
            problems.append(
                ("offload_optimizer.ratio", f"below 1.0 needs stage 3; stage is {self.stage}")
            )
        if (
            self.offload_param is not None
            and self.offload_param.device != "none"
            and self.stage != 3
        ):
            problems.append(
                ("offload_param", f"needs stage 3; stage is {self.stage} (use offload_optimizer)")
            )
        if problems:
            raise raw_problems_error(problems)
        return self
