"""The feature table: every config section or key whose feature DeepShard does not run yet.

This is the one source of what works. The engine refuses a config that asks for a ``planned``
row (`planned_problems`) and reports the ``ignored`` rows it asks for (`asked_features`,
`ignored_keys`); the README, the docs index and the config reference show the same rows. A row
moves to available (it is deleted) in the change that wires its feature.
"""

from __future__ import annotations

from deepshard.interface.status._model import FeatureStatus, When

__all__ = ["FEATURES"]

_ZERO = "deepshard-zero"
_ENGINE = "deepshard"
_OFF = "none"
_SET_FALSE = "set it to false or remove it"
_STAGE3 = "ZeRO stage 3 setting (no effect at stages 0-2)"

_STAGE3_KEYS = (
    "stage3_gather_16bit_weights_on_model_save",
    "stage3_module_granularity_threshold",
    "stage3_use_all_reduce_for_fetch_params",
    "stage3_allgather_sequential",
    "zero_hpz_partition_size",
    "zero_quantized_weights",
    "zero_quantized_nontrainable_weights",
    "zero_quantized_gradients",
    "zeropp_loco_param",
    "memory_efficient_linear",
    "pipeline_loading_checkpoint",
    "override_module_apply",
    "log_trace_cache_warnings",
    "enable_sanity_checks",
    "leaf_module",
)

_PLANNED = (
    FeatureStatus(
        "data_efficiency.data_routing.random_ltd.layer_token_lr_schedule.enabled",
        "planned",
        "learning rate by consumed layer-tokens (DeepSpeed 0.19.7 refuses it too)",
        _ENGINE,
        When("true"),
        fix=_SET_FALSE,
    ),
)

_IGNORED = (
    FeatureStatus(
        "sparse_gradients",
        "ignored",
        "the sparse all-gather of embedding gradients (they are reduced densely, with the same "
        "result; sparse=True embeddings train at every stage)",
        _ZERO,
        When("true"),
    ),
    FeatureStatus(
        "checkpoint.load_universal",
        "ignored",
        "no effect: every engine.load_checkpoint reshards",
        None,
        When("true"),
    ),
    FeatureStatus(
        "checkpoint.use_node_local_storage",
        "ignored",
        "node-local checkpoint storage (every rank writes to the one shared directory)",
        "deepshard-checkpoint",
        When("true"),
    ),
    FeatureStatus(
        "checkpoint.parallel_write",
        "ignored",
        "pipeline-stage parallel checkpoint writes (every rank writes its own file already)",
        "deepshard-checkpoint",
        When("true", field="pipeline_stage"),
    ),
    FeatureStatus(
        "checkpoint.checkpoint_serialization",
        "ignored",
        "no effect: checkpoints are always safetensors and JSON",
        None,
        When("false"),
    ),
    FeatureStatus(
        "checkpoint.writer",
        "ignored",
        "DeepSpeed's checkpoint writers (use checkpoint.async_save for background writes)",
        "deepshard-checkpoint",
        When("given"),
    ),
    FeatureStatus(
        "timers",
        "ignored",
        "throughput timers (the progress line always has samples/s)",
        "deepshard-profiler",
    ),
    *(
        FeatureStatus(key, "ignored", f"the {name} monitor", _ENGINE, When("true", field="enabled"))
        for key, name in (
            ("tensorboard", "TensorBoard"),
            ("wandb", "Weights & Biases"),
            ("csv_monitor", "CSV"),
            ("comet", "Comet"),
        )
    ),
    FeatureStatus(
        "tensor_parallel", "ignored", "an AutoTP setting AutoTP does not read", "deepshard-autotp"
    ),
    *(
        FeatureStatus(f"tensor_parallel.{key}", "available", what, "deepshard-autotp")
        for key, what in (
            ("autotp_size", "AutoTP tensor parallelism"),
            ("tp.tp_size", "AutoTP tensor parallelism"),
            ("tp.tp_grain_size", "AutoTP shard-size grain"),
            ("tp_overlap_comm", "AutoTP communication overlap"),
            ("dtype", "AutoTP dtype (checked against the engine's precision)"),
            ("partition_config", "AutoTP partition specs"),
            ("preset_model", "AutoTP presets"),
        )
    ),
    FeatureStatus(
        "moe",
        "ignored",
        "MoE layer settings (read by `deepshard.autoep.MoE.from_config`, not by `initialize`)",
        "deepshard-autoep",
    ),
    FeatureStatus(
        "moe.ep_size", "available", "the expert-parallel axis of the mesh", "deepshard-comm"
    ),
    FeatureStatus(
        "expert_parallel",
        "available",
        "AutoEP expert parallelism, expert TP, engine checkpoints at ZeRO 0-3",
        "deepshard-autoep",
    ),
    FeatureStatus(
        "use_data_before_expert_parallelism",
        "ignored",
        "expert-group rank order",
        "deepshard-autoep",
    ),
    FeatureStatus(
        "seq_parallel_communication_data_type",
        "ignored",
        "the Ulysses all-to-all dtype",
        "deepshard-sequence-parallel",
    ),
    *(FeatureStatus(f"zero_optimization.{key}", "ignored", _STAGE3, _ZERO) for key in _STAGE3_KEYS),
    FeatureStatus(
        "zero_optimization.load_from_fp32_weights",
        "ignored",
        "checkpoint loading",
        "deepshard-checkpoint",
    ),
    FeatureStatus(
        "zero_optimization.elastic_checkpoint",
        "ignored",
        "checkpoint loading",
        "deepshard-checkpoint",
    ),
    FeatureStatus(
        "zero_optimization.contiguous_gradients",
        "ignored",
        "no effect: gradients always live in contiguous flat buckets",
        None,
        When("false"),
    ),
    FeatureStatus(
        "zero_optimization.round_robin_gradients",
        "ignored",
        "no effect: buckets are reduced in one fixed order",
        None,
        When("true"),
    ),
    FeatureStatus(
        "zero_optimization.use_multi_rank_bucket_allreduce",
        "ignored",
        "no effect: each bucket is one collective",
        None,
    ),
    FeatureStatus(
        "disable_allgather",
        "ignored",
        "no effect: updated partitions are always all-gathered",
        None,
        When("true"),
    ),
    FeatureStatus(
        "graph_harvesting", "ignored", "device-graph capture of the step", _ENGINE, When("true")
    ),
    FeatureStatus("vocabulary_size", "ignored", "the vocabulary-size warning", _ENGINE),
    FeatureStatus(
        "bf16.check_grad_overflow",
        "ignored",
        "no effect: ZeRO always skips a step whose gradients are not finite (the flag travels "
        "in the gradient-norm all-reduce)",
        None,
        When("false"),
    ),
    FeatureStatus(
        "bf16.immediate_grad_update",
        "ignored",
        "no effect: gradients are reduced into ZeRO's buckets as they are produced",
        None,
    ),
    FeatureStatus("optimizer.legacy_fusion", "ignored", "no effect: DeepSpeed's legacy flag", None),
    *(
        FeatureStatus(
            key, "ignored", f"no effect: not a DeepSpeed key (DeepSpeed ignores it too{why})", None
        )
        for key, why in (
            ("comms_config", ""),
            ("monitor_config", ""),
            (
                "fp8",
                "; FP8 training is set up outside the engine, e.g. with Transformer Engine or "
                "torchao",
            ),
            ("cuda_visible_devices", "; use CUDA_VISIBLE_DEVICES or ds-launch --include"),
        )
    ),
    *(
        FeatureStatus(
            f"sequence_parallel.{key}",
            "ignored",
            "no effect: LLaMA-Factory's key (DeepSpeed ignores its block too); the degree is "
            "sequence_parallel_size, tiling is tiled_mlp / tiled_logits_loss",
            None,
        )
        for key in ("enabled", "size", "mode", "ulysses", "tiling", "memory_optimizations")
    ),
)

FEATURES: tuple[FeatureStatus, ...] = _PLANNED + _IGNORED
"""Every row, planned ones first."""
