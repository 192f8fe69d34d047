"""Realistic DeepSpeed JSON configs (tests/configs/*.json) parse with the values they carry."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from deepshard.interface import ConfigError, DeepShardConfig

CONFIGS = Path(__file__).parent / "configs"


def _raw(name: str) -> dict:
    return json.loads((CONFIGS / name).read_text())


def _zero1(cfg: DeepShardConfig, raw: dict) -> None:
    assert cfg.zero_optimization.stage == 1
    assert cfg.zero_optimization.overlap_comm is False  # DeepSpeed's default below stage 3
    assert cfg.zero_optimization.reduce_bucket_size == int(
        raw["zero_optimization"]["reduce_bucket_size"]
    )
    assert cfg.fp16.enabled and cfg.fp16.dynamic_loss_scale
    assert cfg.fp16.initial_scale_power == raw["fp16"]["initial_scale_power"]
    assert cfg.fp16.loss_scale_window == raw["fp16"]["loss_scale_window"]
    assert cfg.optimizer is not None and cfg.optimizer.type == "Adam"
    assert cfg.optimizer.params == raw["optimizer"]["params"]
    assert cfg.scheduler is not None and cfg.scheduler.type == "WarmupLR"
    assert (
        cfg.scheduler.params["warmup_num_steps"] == raw["scheduler"]["params"]["warmup_num_steps"]
    )


def _zero2(cfg: DeepShardConfig, raw: dict) -> None:
    zero = cfg.zero_optimization
    assert (zero.stage, zero.overlap_comm, zero.round_robin_gradients) == (2, True, True)
    assert zero.allgather_bucket_size == int(raw["zero_optimization"]["allgather_bucket_size"])
    assert cfg.bf16.enabled and not cfg.fp16.enabled
    assert cfg.scheduler is not None and cfg.scheduler.type == "WarmupDecayLR"


def _zero3_knobs(cfg: DeepShardConfig, raw: dict) -> None:
    zero, rz = cfg.zero_optimization, raw["zero_optimization"]
    assert zero.stage == 3 and zero.overlap_comm is True  # stage-3 default
    assert zero.max_live_parameters == int(rz["stage3_max_live_parameters"])
    assert zero.max_reuse_distance == int(rz["stage3_max_reuse_distance"])
    assert zero.prefetch_bucket_size == int(rz["stage3_prefetch_bucket_size"])
    assert zero.param_persistence_threshold == int(rz["stage3_param_persistence_threshold"])
    assert zero.gather_16bit_weights_on_model_save is True
    assert zero.zero_hpz_partition_size == rz["zero_hpz_partition_size"]
    assert zero.zero_quantized_weights and zero.zero_quantized_gradients
    assert cfg.data_types.grad_accum_dtype == "fp32"
    assert cfg.bf16.immediate_grad_update is True
    assert cfg.gradient_clipping == raw["gradient_clipping"]
    assert cfg.scheduler is not None and cfg.scheduler.type == "WarmupCosineLR"


def _zero3_cpu(cfg: DeepShardConfig, raw: dict) -> None:
    zero = cfg.zero_optimization
    assert zero.offload_optimizer is not None and zero.offload_optimizer.device == "cpu"
    assert zero.offload_param is not None and zero.offload_param.device == "cpu"
    assert zero.offload_param.pin_memory and zero.offload_optimizer.pin_memory
    assert zero.gather_16bit_weights_on_model_save is True  # via the fp16 spelling
    assert zero.sub_group_size == int(raw["zero_optimization"]["sub_group_size"])
    assert cfg.zero_allow_untested_optimizer and cfg.zero_force_ds_cpu_optimizer


def _zero3_nvme(cfg: DeepShardConfig, raw: dict) -> None:
    zero, ro = cfg.zero_optimization, raw["zero_optimization"]["offload_optimizer"]
    assert zero.offload_optimizer is not None and zero.offload_param is not None
    assert zero.offload_optimizer.device == "nvme"
    assert str(zero.offload_optimizer.nvme_path) == ro["nvme_path"]
    assert zero.offload_optimizer.pipeline
    assert zero.offload_param.buffer_size == int(
        raw["zero_optimization"]["offload_param"]["buffer_size"]
    )
    assert cfg.aio.queue_depth == raw["aio"]["queue_depth"]
    assert cfg.aio.intra_op_parallelism == raw["aio"]["intra_op_parallelism"]


def _bfloat16(cfg: DeepShardConfig, raw: dict) -> None:
    assert cfg.bf16.enabled and cfg.bf16.check_grad_overflow
    assert cfg.communication_data_type == "fp32"
    assert cfg.gradient_allreduce_op == "sum"
    assert cfg.optimizer is not None and cfg.optimizer.type == "SGD"
    assert cfg.scheduler is not None and cfg.scheduler.params == raw["scheduler"]["params"]


def _profiling(cfg: DeepShardConfig, raw: dict) -> None:
    flops, rf = cfg.flops_profiler, raw["flops_profiler"]
    assert flops.enabled and not flops.detailed
    assert (flops.profile_step, flops.module_depth, flops.top_modules) == (
        rf["profile_step"],
        rf["module_depth"],
        rf["top_modules"],
    )
    assert flops.output_file == rf["output_file"]
    assert cfg.comms_logger.enabled and not cfg.comms_logger.prof_all and cfg.comms_logger.debug
    assert cfg.comms_logger.prof_ops == raw["comms_logger"]["prof_ops"]
    assert cfg.timers.throughput.synchronized is False
    assert cfg.wall_clock_breakdown and cfg.memory_breakdown


def _activation(cfg: DeepShardConfig, raw: dict) -> None:
    act = cfg.activation_checkpointing
    assert act.partition_activations and act.cpu_checkpointing and act.profile
    assert act.number_checkpoints == raw["activation_checkpointing"]["number_checkpoints"]
    assert cfg.tensorboard.output_path == raw["tensorboard"]["output_path"]
    assert cfg.wandb.team == "ml" and cfg.csv_monitor.enabled
    assert cfg.checkpoint.tag_validation == "FAIL"  # DeepSpeed matches it case-insensitively
    assert cfg.checkpoint.load_universal and cfg.checkpoint.use_node_local_storage
    assert cfg.steps_per_print == raw["steps_per_print"]


def _tensor_parallel(cfg: DeepShardConfig, raw: dict) -> None:
    tp = cfg.tensor_parallel
    assert tp.autotp_size == raw["tensor_parallel"]["autotp_size"] and tp.tp_overlap_comm
    assert tp.partition_config is not None and not tp.partition_config.use_default_specs
    specs = tp.partition_config.layer_specs
    assert [s.partition_type for s in specs] == ["row", "column", "column"]
    assert specs[2].shape == [2, -1] and specs[2].partition_dim == 0
    assert cfg.sequence_parallel_size == raw["sequence_parallel_size"]
    assert cfg.topology(16).shape == (1, 16 // (4 * 2), 1, 2, 4)


HF_FILLED_DP_WORLD_SIZE = 8
"""Data-parallel size hf_trainer_filled.json was written for (64 = 4 micro x 2 accum x 8)."""


def _hf_filled(cfg: DeepShardConfig, raw: dict) -> None:
    zero = cfg.zero_optimization
    assert (
        zero.stage == 3
        and zero.prefetch_bucket_size == raw["zero_optimization"]["stage3_prefetch_bucket_size"]
    )
    assert zero.offload_optimizer is not None and zero.offload_optimizer.device == "none"
    assert cfg.bf16.enabled and not cfg.fp16.enabled
    # The HF Trainer filled this file for a launch on HF_FILLED_DP_WORLD_SIZE data-parallel ranks.
    sizes = cfg.resolve_batch(HF_FILLED_DP_WORLD_SIZE)
    assert sizes.train_batch_size == raw["train_batch_size"]
    assert sizes.train_micro_batch_size_per_gpu == raw["train_micro_batch_size_per_gpu"]
    assert sizes.gradient_accumulation_steps == raw["gradient_accumulation_steps"]
    with pytest.raises(ConfigError):
        cfg.resolve_batch(HF_FILLED_DP_WORLD_SIZE // 2)


def _moe_elastic(cfg: DeepShardConfig, raw: dict) -> None:
    elastic, moe, curriculum = raw["elasticity"], raw["moe"], raw["curriculum_learning"]
    assert cfg.elasticity.enabled is elastic["enabled"]
    assert cfg.elasticity.micro_batch_sizes == elastic["micro_batch_sizes"]
    assert cfg.elasticity.num_gpus_per_node == elastic["num_gpus_per_node"]
    assert (cfg.moe.ep_size, cfg.moe.num_experts, cfg.moe.top_k) == (
        moe["ep_size"],
        moe["num_experts"],
        moe["top_k"],
    )
    assert cfg.moe.noisy_gate_policy == moe["noisy_gate_policy"]
    assert cfg.ep_size == moe["ep_size"]
    assert cfg.curriculum_learning.enabled is curriculum["enabled"]
    assert cfg.curriculum_learning.schedule_type == curriculum["schedule_type"]
    assert (
        cfg.curriculum_learning.schedule_config.total_curriculum_step
        == curriculum["schedule_config"]["total_curriculum_step"]
    )
    raw_ltd = raw["data_efficiency"]["data_routing"]["random_ltd"]
    ltd = cfg.data_efficiency.data_routing.random_ltd
    assert ltd.enabled is raw_ltd["enabled"]
    assert ltd.random_ltd_layer_id == raw_ltd["random_ltd_layer_id"]
    assert (
        ltd.random_ltd_schedule.schedule_config.require_steps
        == raw_ltd["random_ltd_schedule"]["schedule_config"]["require_steps"]
    )
    assert cfg.data_efficiency.seed == raw["data_efficiency"]["seed"]


CHECKS: dict[str, Callable[[DeepShardConfig, dict], None]] = {
    "zero1_fp16_warmuplr.json": _zero1,
    "zero2_overlap_warmupdecay.json": _zero2,
    "zero3_stage3_knobs_cosine.json": _zero3_knobs,
    "zero3_offload_cpu.json": _zero3_cpu,
    "zero3_nvme_infinity.json": _zero3_nvme,
    "bfloat16_legacy_onecycle.json": _bfloat16,
    "profiling_flops_comms.json": _profiling,
    "activation_checkpointing_monitors.json": _activation,
    "tensor_parallel_autotp.json": _tensor_parallel,
    "hf_trainer_filled.json": _hf_filled,
    "moe_elastic_curriculum.json": _moe_elastic,
}


def test_every_stored_config_is_checked() -> None:
    stored = {p.name for p in CONFIGS.glob("*.json")}
    assert stored == set(CHECKS) | {"hf_trainer_auto.json"}
    assert len(CHECKS) >= 10


@pytest.mark.parametrize("name", sorted(CHECKS))
def test_config_parses_with_its_values(name: str) -> None:
    cfg = DeepShardConfig.from_file(CONFIGS / name)
    CHECKS[name](cfg, _raw(name))
    assert DeepShardConfig.from_dict(cfg.to_dict()) == cfg


def test_hf_auto_placeholders_are_refused_where_deepspeed_fails_on_them() -> None:
    """Top-level numbers and optimizer params: DeepSpeed fails on "auto", so it is refused."""
    with (
        pytest.warns(UserWarning, match="'auto'") as warned,
        pytest.raises(ConfigError, match="Hugging Face Trainer") as info,
    ):
        DeepShardConfig.from_file(CONFIGS / "hf_trainer_auto.json")
    paths = {path for path, _ in info.value.problems}
    assert {
        "optimizer.params.lr",
        "optimizer.params.betas",
        "gradient_accumulation_steps",
        "gradient_clipping",
        "train_batch_size",
        "train_micro_batch_size_per_gpu",
    } <= paths
    # Inside DeepSpeed's pydantic sections "auto" is the default: warned, not refused.
    assert not {"bf16.enabled", "zero_optimization.reduce_bucket_size"} & paths
    said = " ".join(str(w.message) for w in warned)
    assert "bf16.enabled (default False)" in said
    assert "zero_optimization.reduce_bucket_size (default 500000000)" in said


def test_auto_inside_deepspeed_pydantic_sections_is_the_default() -> None:
    """OpenRLHF hands "auto" to deepspeed.initialize directly; DeepSpeed drops it there."""
    raw = {
        "train_micro_batch_size_per_gpu": 1,
        "bf16": {"enabled": True},
        "zero_optimization": {
            "stage": 3,
            "sub_group_size": "auto",
            "stage3_max_live_parameters": "auto",
            "stage3_max_reuse_distance": "auto",
            "offload_optimizer": {"device": "cpu", "pin_memory": "auto"},
        },
        "tensorboard": {"enabled": False, "output_path": "auto"},
    }
    with pytest.warns(UserWarning, match="stage3_max_live_parameters") as warned:
        cfg = DeepShardConfig.from_dict(raw)
    plain = DeepShardConfig.from_dict(
        {
            "train_micro_batch_size_per_gpu": 1,
            "bf16": {"enabled": True},
            "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}},
            "tensorboard": {"enabled": False},
        }
    )
    assert cfg.zero_optimization == plain.zero_optimization
    assert cfg.tensorboard == plain.tensorboard
    said = " ".join(str(w.message) for w in warned)
    for key in ("sub_group_size", "stage3_max_reuse_distance", "offload_optimizer.pin_memory"):
        assert f"zero_optimization.{key}" in said
    assert raw["zero_optimization"]["sub_group_size"] == "auto"  # the caller's dict untouched
