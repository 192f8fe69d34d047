"""fp16/zero/autocast bounds accept what DeepSpeed 0.19.7 accepts and refuse what would break."""

from __future__ import annotations

from typing import Any

import pytest

from deepshard.interface import ConfigError, DeepShardConfig

DYNAMIC_ON = {"enabled": True, "loss_scale": 0}


def test_torch_autocast_dtype_defaults_to_none() -> None:
    assert DeepShardConfig.from_dict({}).torch_autocast.dtype is None
    on = DeepShardConfig.from_dict({"torch_autocast": {"enabled": True}})
    assert on.torch_autocast.dtype is None


@pytest.mark.parametrize(("spelling", "canonical"), [("bfloat16", "bf16"), ("half", "fp16")])
def test_torch_autocast_dtype_still_accepts_spellings(spelling: str, canonical: str) -> None:
    cfg = DeepShardConfig.from_dict({"torch_autocast": {"enabled": True, "dtype": spelling}})
    assert cfg.torch_autocast.dtype == canonical


def test_torch_autocast_dtype_refuses_unknown() -> None:
    with pytest.raises(ConfigError, match=r"torch_autocast\.dtype"):
        DeepShardConfig.from_dict({"torch_autocast": {"dtype": "int4"}})


def test_zero_hpz_partition_size_zero_is_accepted() -> None:
    cfg = DeepShardConfig.from_dict({"zero_optimization": {"zero_hpz_partition_size": 0}})
    assert cfg.zero_optimization.zero_hpz_partition_size == 0
    with pytest.raises(ConfigError, match="zero_hpz_partition_size"):
        DeepShardConfig.from_dict({"zero_optimization": {"zero_hpz_partition_size": -1}})


BAD_DYNAMIC_VALUES = [("loss_scale_window", 0), ("min_loss_scale", 0), ("hysteresis", 0)]


@pytest.mark.parametrize(("key", "value"), BAD_DYNAMIC_VALUES)
@pytest.mark.parametrize(
    "fp16", [{"enabled": False}, {"enabled": True, "loss_scale": 128}], ids=["off", "static"]
)
def test_unused_dynamic_scaling_values_parse(key: str, value: int, fp16: dict[str, Any]) -> None:
    cfg = DeepShardConfig.from_dict({"fp16": {**fp16, key: value}})
    assert getattr(cfg.fp16, key) == value


@pytest.mark.parametrize(("key", "value"), BAD_DYNAMIC_VALUES)
def test_dynamic_scaling_refuses_bad_values(key: str, value: int) -> None:
    with pytest.raises(ConfigError, match=rf"fp16\.{key}") as info:
        DeepShardConfig.from_dict({"fp16": {**DYNAMIC_ON, key: value}})
    assert "dynamic loss scaling" in str(info.value)


def test_min_loss_scale_accepts_int_and_float() -> None:
    as_int = DeepShardConfig.from_dict({"fp16": {**DYNAMIC_ON, "min_loss_scale": 2}}).fp16
    as_float = DeepShardConfig.from_dict({"fp16": {**DYNAMIC_ON, "min_loss_scale": 0.25}}).fp16
    assert isinstance(as_int.min_loss_scale, int) and as_int.min_loss_scale == 2
    assert as_float.min_loss_scale == 0.25


def test_min_loss_scale_must_be_finite() -> None:
    with pytest.raises(ConfigError, match=r"fp16\.min_loss_scale"):
        DeepShardConfig.from_dict({"fp16": {"min_loss_scale": float("inf")}})


def test_flops_profiler_step_zero_is_accepted() -> None:
    cfg = DeepShardConfig.from_dict({"flops_profiler": {"profile_step": 0}})
    assert cfg.flops_profiler.profile_step == 0
