"""Section defaults equal DeepSpeed's own pydantic models, field by field (needs deepspeed).

DeepSpeed is in the optional ``bench`` group, so this module is skipped when it is absent. The
allow-lists name every stated deviation (see the field docstrings) and every DeepSpeed field
DeepShard does not carry as a field of the same name.
"""

from __future__ import annotations

import enum
import importlib
from typing import Any

import pydantic
import pytest

from deepshard.interface.config import (
    Bf16Config,
    CometConfig,
    CommsLoggerConfig,
    CsvMonitorConfig,
    Fp16Config,
    LeafModuleConfig,
    OffloadOptimizerConfig,
    OffloadParamConfig,
    TensorBoardConfig,
    WandbConfig,
    ZeroConfig,
)

pytest.importorskip("deepspeed")

# (our section, DeepSpeed module, DeepSpeed class)
PAIRS: list[tuple[type[pydantic.BaseModel], str, str]] = [
    (ZeroConfig, "deepspeed.runtime.zero.config", "DeepSpeedZeroConfig"),
    (
        LeafModuleConfig,
        "deepspeed.runtime.zero.leaf_module_config",
        "DeepSpeedZeroLeafModuleConfig",
    ),
    (
        OffloadParamConfig,
        "deepspeed.runtime.zero.offload_config",
        "DeepSpeedZeroOffloadParamConfig",
    ),
    (
        OffloadOptimizerConfig,
        "deepspeed.runtime.zero.offload_config",
        "DeepSpeedZeroOffloadOptimizerConfig",
    ),
    (Fp16Config, "deepspeed.runtime.precision_config", "DeepSpeedFP16Config"),
    (Bf16Config, "deepspeed.runtime.precision_config", "DeepSpeedBF16Config"),
    (CommsLoggerConfig, "deepspeed.comm.config", "CommsLoggerConfig"),
    (TensorBoardConfig, "deepspeed.monitor.config", "TensorBoardConfig"),
    (WandbConfig, "deepspeed.monitor.config", "WandbConfig"),
    (CsvMonitorConfig, "deepspeed.monitor.config", "CSVConfig"),
    (CometConfig, "deepspeed.monitor.config", "CometConfig"),
]

# Stated deviations of default values: (our class, field).
DEFAULT_DEVIATIONS: set[tuple[str, str]] = {
    ("TensorBoardConfig", "job_name"),
    ("CsvMonitorConfig", "job_name"),
    ("WandbConfig", "project"),
}

# DeepSpeed fields DeepShard does not carry under that name (removed keys are refused with their
# replacement, see _removed.py; the old cpu_offload switches are rewritten into the sections that
# replaced them, see _legacy_offload.py and the test below).
NOT_CARRIED: set[tuple[str, str]] = {
    ("ZeroConfig", "cpu_offload_param"),
    ("ZeroConfig", "cpu_offload_use_pin_memory"),
    ("ZeroConfig", "cpu_offload"),
    ("ZeroConfig", "stage3_gather_fp16_weights_on_model_save"),
    ("ZeroConfig", "legacy_stage1"),
    ("ZeroConfig", "zenflow"),
}


def _plain(value: Any) -> Any:
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, pydantic.BaseModel):
        return {name: _plain(getattr(value, name)) for name in type(value).model_fields}
    return value


@pytest.mark.parametrize(("ours", "module", "name"), PAIRS, ids=[p[0].__name__ for p in PAIRS])
def test_defaults_match_deepspeed_model(
    ours: type[pydantic.BaseModel], module: str, name: str
) -> None:
    theirs: type[pydantic.BaseModel] = getattr(importlib.import_module(module), name)
    our_default, their_default = ours(), theirs()
    label = ours.__name__
    missing = {field for field in theirs.model_fields if field not in ours.model_fields} - {
        field for cls, field in NOT_CARRIED if cls == label
    }
    assert not missing, f"{label} lacks DeepSpeed fields {sorted(missing)}"
    mismatches = {}
    for field in theirs.model_fields:
        if field not in ours.model_fields or (label, field) in DEFAULT_DEVIATIONS:
            continue
        mine = _plain(getattr(our_default, field))
        expected = _plain(getattr(their_default, field))
        if isinstance(mine, dict) and isinstance(expected, dict):
            mine = {k: v for k, v in mine.items() if k in expected}
        if mine != expected:
            mismatches[field] = (mine, expected)
    assert not mismatches, f"{label} (ours, DeepSpeed's): {mismatches}"


@pytest.mark.parametrize(("cls", "field"), sorted(DEFAULT_DEVIATIONS))
def test_each_default_deviation_is_stated(cls: str, field: str) -> None:
    ours = next(p[0] for p in PAIRS if p[0].__name__ == cls)
    description = ours.model_fields[field].description or ""
    assert "Deliberate deviation" in description


@pytest.mark.parametrize(
    "section",
    [
        {"stage": 2, "cpu_offload": True},
        {"stage": 2, "cpu_offload": False},
        {"stage": 1, "cpu_offload": None, "cpu_offload_use_pin_memory": True},
        {"stage": 3, "cpu_offload_param": True, "cpu_offload": True},
        {"stage": 3, "cpu_offload_param": False, "cpu_offload_use_pin_memory": True},
    ],
)
def test_old_offload_switches_map_like_deepspeed(section: dict[str, Any]) -> None:
    """DeepSpeed's own model rewrites the switches into the same offload sections as ours."""
    import warnings

    theirs_cls = importlib.import_module("deepspeed.runtime.zero.config").DeepSpeedZeroConfig
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        ours = ZeroConfig(**section)
    theirs = theirs_cls(**section)
    for field in ("offload_optimizer", "offload_param"):
        mine, expected = _plain(getattr(ours, field)), _plain(getattr(theirs, field))
        if isinstance(mine, dict) and isinstance(expected, dict):
            mine = {k: v for k, v in mine.items() if k in expected}
        assert mine == expected, f"{field}: {mine} (ours) != {expected} (DeepSpeed's)"
