"""Configs that training frameworks generate, which DeepSpeed 0.19.7 accepts, parse here too.

Each dict has the shape its framework writes (DeepSpeed-Chat's ``get_train_ds_config``,
OpenRLHF's ``get_train_ds_config``, LLaMA-Factory's shipped JSON files) with the Hugging Face
Trainer's "auto" placeholders filled where the Trainer fills them. Every block a framework
adds that DeepSpeed reads and then does nothing with is accepted, not acted on, and reported
by `ignored_keys` where it is not DeepSpeed's own switched-off section.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest

from deepshard.interface import ConfigError, DeepShardConfig
from deepshard.interface.status import ignored_keys

DSCHAT_STAGE3 = {
    "train_batch_size": 32,
    "train_micro_batch_size_per_gpu": 4,
    "steps_per_print": 10,
    "zero_optimization": {
        "stage": 3,
        "overlap_comm": True,
        "offload_param": {"device": "none"},
        "offload_optimizer": {"device": "none"},
        "stage3_param_persistence_threshold": 1e4,
        "stage3_max_live_parameters": 3e7,
        "stage3_prefetch_bucket_size": 3e7,
        "memory_efficient_linear": False,
    },
    "fp16": {"enabled": True, "loss_scale_window": 100},
    "gradient_clipping": 1.0,
    "prescale_gradients": False,
    "wall_clock_breakdown": False,
    "hybrid_engine": {
        "enabled": False,
        "max_out_tokens": 512,
        "inference_tp_size": 1,
        "release_inference_cache": False,
        "pin_parameters": True,
        "tp_gather_partition_size": 8,
    },
    "tensorboard": {"enabled": False, "output_path": "/tmp/tb", "job_name": "step3"},
}

OPENRLHF_STAGE3 = {
    "train_micro_batch_size_per_gpu": 1,
    "train_batch_size": 128,
    "zero_optimization": {
        "stage": 3,
        "offload_param": {"device": "none"},
        "offload_optimizer": {"device": "none", "pin_memory": True},
        "zero_hpz_partition_size": 1,
        "reduce_scatter": True,
    },
    "bf16": {"enabled": True},
    "gradient_clipping": 1.0,
    "data_types": {"grad_accum_dtype": None},
    "checkpoint": {"load_universal": False},
    "compile": {"deepcompile": False},
}

LLAMAFACTORY_STAGE2 = {
    "_comment": "supported model list: see the AutoTP tutorial",
    "train_batch_size": 16,
    "train_micro_batch_size_per_gpu": 4,
    "gradient_accumulation_steps": 2,
    "gradient_clipping": 1.0,
    "zero_allow_untested_optimizer": True,
    "bf16": {"enabled": True},
    "zero_optimization": {"stage": 2, "overlap_comm": False, "round_robin_gradients": True},
    "comms_logger": {"enabled": False},
    "comms_config": {"verbose": False},
    "monitor_config": {
        "enabled": True,
        "tag": "DeepSpeedMonitor",
        "csv_monitor": {"enabled": False},
    },
    "fp8": {"enabled": True, "loss_scale_window": 1000, "hysteresis": 2, "min_loss_scale": 1},
}


def _parse(raw: dict[str, Any]) -> DeepShardConfig:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # none of these configs needs a warning
        return DeepShardConfig.from_dict(raw, dp_world_size=2)


def test_deepspeed_chat_hybrid_engine_switched_off_is_accepted() -> None:
    cfg = _parse(DSCHAT_STAGE3)
    assert cfg.hybrid_engine.enabled is False
    assert cfg.hybrid_engine.tp_gather_partition_size == 8
    assert cfg.zero_optimization.stage == 3 and cfg.fp16.enabled
    assert DeepShardConfig.from_dict(cfg.to_dict()) == cfg


def test_openrlhf_deepcompile_switched_off_is_accepted() -> None:
    cfg = _parse(OPENRLHF_STAGE3)
    assert cfg.compile.deepcompile is False
    assert DeepShardConfig.from_dict(cfg.to_dict()) == cfg


def test_llamafactory_extra_blocks_are_accepted_and_reported() -> None:
    cfg = _parse(LLAMAFACTORY_STAGE2)
    assert "_comment" not in cfg.to_dict()
    assert cfg.comms_config == {"verbose": False}
    reported = ignored_keys(cfg)
    for key in ("comms_config.verbose", "monitor_config.tag", "fp8.enabled"):
        assert key in reported
    assert not any(key.startswith("comms_logger") for key in reported)
    assert DeepShardConfig.from_dict(cfg.to_dict()) == cfg


@pytest.mark.parametrize(
    ("raw", "path", "fragment"),
    [
        ({"hybrid_engine": {"enabled": True}}, "hybrid_engine.enabled", "build_rollout"),
        ({"compile": {"deepcompile": True}}, "compile.deepcompile", "torch.compile"),
        ({"compile": {"deepcompile": False, "backend": "inductor"}}, "compile.backend", "unknown"),
        ({"hybrid_engine": {"max_out_tokens": 0}}, "hybrid_engine.max_out_tokens", "> 0"),
    ],
)
def test_switched_on_or_mistyped_sections_are_refused(
    raw: dict[str, Any], path: str, fragment: str
) -> None:
    with pytest.raises(ConfigError) as info:
        DeepShardConfig.from_dict(raw)
    problems = dict(info.value.problems)
    assert fragment in problems[path]


def test_llamafactory_alst_block_is_accepted_and_reported() -> None:
    """LLaMA-Factory writes its own `sequence_parallel` block; DeepSpeed ignores all of it."""
    raw = {
        "train_micro_batch_size_per_gpu": 1,
        "sequence_parallel_size": 2,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 3},
        "sequence_parallel": {
            "enabled": True,
            "size": 4,
            "mode": "ulysses",
            "ulysses": {"degree": 4, "seq_length_is_variable": True},
            "tiling": {"enabled": True, "chunk_size": 8192},
            "memory_optimizations": {"enabled": True, "pytorch_profiling": False},
        },
    }
    cfg = _parse(raw)
    assert cfg.sequence_parallel_size == 2  # the degree DeepSpeed reads, not the block's 4
    assert not cfg.sequence_parallel.tiled_mlp and not cfg.sequence_parallel.tiled_logits_loss
    reported = ignored_keys(cfg)
    for key in ("sequence_parallel.size", "sequence_parallel.tiling.chunk_size"):
        assert key in reported
    assert DeepShardConfig.from_dict(cfg.to_dict()) == cfg
