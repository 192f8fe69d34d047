"""The feature table names real keys, and a config's questions against it are answered right."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest
from pydantic import BaseModel

from deepshard.interface import DeepShardConfig
from deepshard.interface.config._keys import json_key, unwrap_optional
from deepshard.interface.status import (
    FEATURES,
    asked_features,
    ignored_keys,
    planned_problems,
    status_of,
)


def _schema_paths(model: type[BaseModel], prefix: str = "") -> set[str]:
    """Every DeepSpeed key path of the schema, sections and leaves, walked from the models."""
    paths = set()
    for name, info in model.model_fields.items():
        path = f"{prefix}{json_key(name, info)}"
        paths.add(path)
        for member in unwrap_optional(info.annotation):
            if isinstance(member, type) and issubclass(member, BaseModel):
                paths |= _schema_paths(member, f"{path}.")
    return paths


SCHEMA = _schema_paths(DeepShardConfig)


@pytest.mark.parametrize("row", FEATURES, ids=lambda row: row.key)
def test_every_row_names_a_key_of_the_schema(row: Any) -> None:
    assert row.key in SCHEMA, f"{row.key} is not a config key (typo in the feature table?)"
    if row.when.field:
        assert f"{row.key}.{row.when.field}" in SCHEMA


def test_rows_are_unique_and_planned_rows_say_who_brings_them() -> None:
    keys = [row.key for row in FEATURES]
    assert len(keys) == len(set(keys))
    assert all(row.package for row in FEATURES if row.status == "planned")


def test_the_longest_row_covers_a_key() -> None:
    assert status_of("moe.top_k").key == "moe"  # type: ignore[union-attr]
    assert status_of("moe.ep_size").status == "available"  # type: ignore[union-attr]
    assert status_of("tensorboard.output_path").key == "tensorboard"  # type: ignore[union-attr]
    assert status_of("zero_optimization.reduce_bucket_size") is None
    assert status_of("tensor_parallel.tp.tp_size").status == "available"  # type: ignore[union-attr]
    assert status_of("tensor_parallel.keep_module_on_host").status == "ignored"  # type: ignore[union-attr]
    assert status_of("zero_optimization.offload_param.pin_memory") is None  # it runs


ASKS = [
    (
        {
            "data_efficiency": {
                "data_routing": {
                    "random_ltd": {"enabled": True, "layer_token_lr_schedule": {"enabled": True}}
                }
            }
        },
        ["data_efficiency.data_routing.random_ltd.layer_token_lr_schedule.enabled"],
    ),
]


def test_16bit_masters_are_no_longer_planned() -> None:
    bf16 = {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}
    config = DeepShardConfig.from_dict({"bf16": bf16, "zero_optimization": {"stage": 1}})
    assert planned_problems(config) == []
    fp16 = {"enabled": True, "fp16_master_weights_and_grads": True}
    zero = {"stage": 3, "offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"}}
    config = DeepShardConfig.from_dict({"fp16": fp16, "zero_optimization": zero})
    assert planned_problems(config) == []


@pytest.mark.parametrize(("config", "keys"), ASKS, ids=[keys[-1] for _, keys in ASKS])
def test_asking_for_a_planned_feature_is_a_problem_naming_its_key(
    config: dict[str, Any], keys: list[str]
) -> None:
    problems = planned_problems(DeepShardConfig.from_dict(config))
    assert [path for path, _ in problems] == keys
    for path, message in problems:
        row = status_of(path)
        assert row is not None
        assert message.startswith(f"{row.feature} is not available yet (planned in {row.package})")


def test_what_is_not_asked_for_is_not_a_problem() -> None:
    honoured = {
        "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "none"}},
        "tensor_parallel": {"autotp_size": 1},
        "elasticity": {"enabled": False, "max_train_batch_size": 8},
    }
    assert planned_problems(DeepShardConfig.from_dict(honoured)) == []
    assert planned_problems(DeepShardConfig.from_dict({})) == []
    assert planned_problems(DeepShardConfig.from_dict({"zero_optimization": {"stage": 3}})) == []
    # Wired since: caller-owned accumulation, dynamic batching, random-LTD; sparse_gradients
    # runs (its bandwidth saving is an ignored row).
    wired = {
        "managed_gradient_accumulation": False,
        "sparse_gradients": True,
        "data_efficiency": {
            "data_sampling": {"dynamic_batching": {"enabled": True, "max_tokens": 64}},
            "data_routing": {"enabled": True, "random_ltd": {"enabled": True}},
        },
    }
    assert planned_problems(DeepShardConfig.from_dict(wired)) == []


def test_ignored_features_and_keys_are_what_the_user_wrote() -> None:
    config = DeepShardConfig.from_dict(
        {
            "zero_optimization": {
                "stage": 2,
                "contiguous_gradients": True,  # what DeepShard does anyway: honoured
                "stage3_module_granularity_threshold": 1e9,
            },
            "wandb": {"enabled": False, "project": "p"},  # disabled: nothing runs, as asked
            "flops_profiler": {"enabled": True, "profile_step": 3},  # wired: honoured
            # honoured by the engine's checkpoints, except load_universal (every load reshards)
            "checkpoint": {"load_universal": True, "tag_validation": "FAIL", "async_save": True},
            "moe": {"ep_size": 1, "top_k": 2},
        }
    )
    assert [row.key for row in asked_features(config, "ignored")] == [
        "checkpoint.load_universal",
        "moe",
        "zero_optimization.stage3_module_granularity_threshold",
    ]
    assert ignored_keys(config) == [
        "zero_optimization.stage3_module_granularity_threshold",
        "checkpoint.load_universal",
        "moe.top_k",
    ]
    assert ignored_keys(DeepShardConfig.from_dict({"train_batch_size": 8})) == []


def test_a_section_row_is_asked_for_only_through_the_keys_it_covers() -> None:
    available_only = {"tensor_parallel": {"autotp_size": 2, "tp_overlap_comm": True}}
    config = DeepShardConfig.from_dict(available_only)
    assert asked_features(config, "ignored") == []
    assert ignored_keys(config) == []
    both = {"tensor_parallel": {"autotp_size": 2, "keep_module_on_host": True}}
    config = DeepShardConfig.from_dict(both)
    assert [row.key for row in asked_features(config, "ignored")] == ["tensor_parallel"]
    assert ignored_keys(config) == ["tensor_parallel.keep_module_on_host"]


def test_the_status_tables_import_without_torch() -> None:
    code = "import sys, deepshard.interface.status; print('torch' in sys.modules)"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert result.stdout.strip() == "False"


def test_every_activation_checkpointing_key_is_available() -> None:
    # deepshard.engine.checkpointing runs them all (engine.checkpointing), so none is reported
    keys = {
        "partition_activations": True,
        "cpu_checkpointing": True,
        "contiguous_memory_optimization": True,
        "number_checkpoints": 4,
        "synchronize_checkpoint_boundary": True,
        "profile": True,
    }
    config = DeepShardConfig.model_validate({"activation_checkpointing": keys})
    for key in keys:
        assert status_of(f"activation_checkpointing.{key}") is None
    assert asked_features(config, "ignored") == []
    assert ignored_keys(config) == []
