"""Parsing never mutates the caller's dictionary, on success or on failure."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from types import MappingProxyType
from typing import Any

import pytest

from deepshard.interface import ConfigError, DeepShardConfig

CONFIGS = Path(__file__).parent / "configs"


def _frozen(value: Any) -> Any:
    """A deep, hashable snapshot that also records container identities."""
    if isinstance(value, dict):
        return ("dict", id(value), tuple((k, _frozen(v)) for k, v in value.items()))
    if isinstance(value, list):
        return ("list", id(value), tuple(_frozen(v) for v in value))
    return ("leaf", type(value).__name__, value)


def _configs() -> list[dict[str, Any]]:
    loaded = [json.loads(p.read_text()) for p in sorted(CONFIGS.glob("*.json"))]
    # Keys that DeepShard rewrites internally (overlap_comm default, dtype spellings, aliases).
    loaded.append(
        {
            "train_batch_size": 8,
            "bfloat16": {"enabled": True, "check_overflow": False},
            "data_types": {"grad_accum_dtype": "float32"},
            "zero_optimization": {"stage": 3, "stage3_gather_fp16_weights_on_model_save": True},
            "checkpoint": {"tag_validation": "warn"},
        }
    )
    return loaded


@pytest.mark.parametrize("raw", _configs())
@pytest.mark.parametrize("dp_world_size", [None, 1])
def test_successful_or_failed_parse_leaves_the_dict_alone(
    raw: dict[str, Any], dp_world_size: int | None
) -> None:
    before = _frozen(raw)
    reference = copy.deepcopy(raw)
    try:
        cfg = DeepShardConfig.from_dict(raw, dp_world_size=dp_world_size)
    except ConfigError:
        cfg = None
    assert _frozen(raw) == before
    assert raw == reference
    if cfg is not None:  # the parsed config shares no mutable containers with the input
        assert cfg.optimizer is None or cfg.optimizer.params is not raw.get("optimizer", {}).get(
            "params"
        )


def test_read_only_mappings_inside_are_not_written() -> None:
    raw = {"train_batch_size": 8, "zero_optimization": {"stage": 2}}
    cfg = DeepShardConfig.from_dict(raw)
    assert "overlap_comm" not in raw["zero_optimization"]
    assert cfg.zero_optimization.overlap_comm is False
    proxy = MappingProxyType({"stage": 3})
    with pytest.raises(ConfigError):  # not a dict: refused cleanly rather than mutated
        DeepShardConfig.from_dict(proxy)  # type: ignore[arg-type]
