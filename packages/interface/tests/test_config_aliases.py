"""DeepSpeed's alternative key spellings are accepted and written back under the JSON key."""

from __future__ import annotations

from typing import Any

import pytest

from deepshard.interface import ConfigError, DeepShardConfig

STAGE3_KEYS = {
    "stage3_prefetch_bucket_size": "prefetch_bucket_size",
    "stage3_param_persistence_threshold": "param_persistence_threshold",
    "stage3_model_persistence_threshold": "model_persistence_threshold",
    "stage3_max_live_parameters": "max_live_parameters",
    "stage3_max_reuse_distance": "max_reuse_distance",
    "stage3_module_granularity_threshold": "module_granularity_threshold",
}


def test_bfloat16_is_the_bf16_section() -> None:
    old = DeepShardConfig.from_dict({"bfloat16": {"enabled": True}})
    new = DeepShardConfig.from_dict({"bf16": {"enabled": True}})
    assert old == new and old.bf16.enabled
    assert "bf16" in old.to_dict() and "bfloat16" not in old.to_dict()


@pytest.mark.parametrize(("json_key", "attribute"), sorted(STAGE3_KEYS.items()))
@pytest.mark.parametrize("use_json_key", [True, False])
def test_stage3_knobs_accept_both_spellings(
    json_key: str, attribute: str, use_json_key: bool
) -> None:
    value = 12345
    key = json_key if use_json_key else attribute
    cfg = DeepShardConfig.from_dict({"zero_optimization": {"stage": 3, key: value}})
    assert getattr(cfg.zero_optimization, attribute) == value
    written = cfg.to_dict()["zero_optimization"]
    assert written[json_key] == value and attribute not in written


@pytest.mark.parametrize(
    "key",
    [
        "stage3_gather_16bit_weights_on_model_save",
        "stage3_gather_fp16_weights_on_model_save",
        "gather_16bit_weights_on_model_save",
    ],
)
def test_gather_16bit_weights_spellings(key: str) -> None:
    cfg = DeepShardConfig.from_dict({"zero_optimization": {"stage": 3, key: True}})
    assert cfg.zero_optimization.gather_16bit_weights_on_model_save is True
    written = cfg.to_dict()["zero_optimization"]
    assert written["stage3_gather_16bit_weights_on_model_save"] is True
    assert "stage3_gather_fp16_weights_on_model_save" not in written


@pytest.mark.parametrize(
    ("raw", "getter", "expected"),
    [
        ({"bf16": {"check_overflow": False}}, lambda c: c.bf16.check_grad_overflow, False),
        (
            {"data_types": {"grad_accum_dtype": "torch.bfloat16"}},
            lambda c: c.data_types.grad_accum_dtype,
            "bf16",
        ),
        ({"communication_data_type": "half"}, lambda c: c.communication_data_type, "fp16"),
        (
            {"checkpoint": {"tag_validation": "ignore"}},
            lambda c: c.checkpoint.tag_validation,
            "IGNORE",
        ),
        (
            {"checkpoint": {"writer": {"type": "python"}}},
            lambda c: c.checkpoint.writer.type,
            "PYTHON",
        ),
        ({"log_level": "INFO"}, lambda c: c.log_level, "info"),
        (
            {"zero_optimization": {"leaf_module": {"names": "model.moe"}}},
            lambda c: c.zero_optimization.leaf_module.names,
            ["model.moe"],
        ),
    ],
)
def test_deepspeed_spellings_are_normalised(
    raw: dict[str, Any], getter: Any, expected: Any
) -> None:
    assert getter(DeepShardConfig.from_dict(raw)) == expected


@pytest.mark.parametrize(("stage", "expected"), [(0, False), (1, False), (2, False), (3, True)])
def test_overlap_comm_default_depends_on_stage(stage: int, expected: bool) -> None:
    cfg = DeepShardConfig.from_dict({"zero_optimization": {"stage": stage}})
    assert cfg.zero_optimization.overlap_comm is expected
    explicit = DeepShardConfig.from_dict(
        {"zero_optimization": {"stage": stage, "overlap_comm": not expected}}
    )
    assert explicit.zero_optimization.overlap_comm is (not expected)


def test_aio_thread_count_is_the_old_intra_op_parallelism() -> None:
    old = DeepShardConfig.from_dict({"aio": {"thread_count": 4, "queue_depth": 16}})
    assert old.aio.intra_op_parallelism == 4 and old.aio.queue_depth == 16
    assert old == DeepShardConfig.from_dict({"aio": {"intra_op_parallelism": 4, "queue_depth": 16}})
    written = old.to_dict()["aio"]
    assert written["intra_op_parallelism"] == 4 and "thread_count" not in written


def test_aio_thread_count_and_intra_op_parallelism_together_are_refused() -> None:
    with pytest.raises(
        ConfigError, match="given twice, as 'intra_op_parallelism' and 'thread_count'"
    ):
        DeepShardConfig.from_dict({"aio": {"thread_count": 1, "intra_op_parallelism": 1}})
