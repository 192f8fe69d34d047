"""The schema documents itself, is frozen, and carries DeepSpeed 0.19.7's keys and defaults."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Any, get_args, get_origin

import pydantic
import pytest

import deepshard.interface.config as config_pkg
from deepshard.interface import DeepShardConfig, Topology
from deepshard.interface.config import ConfigModel, ZeroConfig
from deepshard.interface.config._keys import accepted_keys, json_key


def _nested_models(annotation: Any) -> Iterator[type[pydantic.BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, pydantic.BaseModel):
        yield annotation
    for arg in get_args(annotation):
        yield from _nested_models(arg)


def _all_models() -> list[type[pydantic.BaseModel]]:
    seen: list[type[pydantic.BaseModel]] = []
    todo: list[type[pydantic.BaseModel]] = [DeepShardConfig, Topology]
    todo += [
        v for v in vars(config_pkg).values() if isinstance(v, type) and issubclass(v, ConfigModel)
    ]
    while todo:
        model = todo.pop()
        if model in seen or model is ConfigModel:
            continue
        seen.append(model)
        for info in model.model_fields.values():
            todo.extend(_nested_models(info.annotation))
    return seen


MODELS = _all_models()


def test_the_walk_reaches_the_deep_sections() -> None:
    names = {m.__name__ for m in MODELS}
    assert {"RandomLtdStepConfig", "TpLayerSpecConfig", "OffloadParamConfig", "LocoConfig"} <= names
    assert len(MODELS) >= 40


@pytest.mark.parametrize("model", MODELS, ids=lambda m: m.__name__)
def test_every_field_and_model_has_a_description(model: type[pydantic.BaseModel]) -> None:
    assert model.__doc__ and model.__doc__.strip()
    undocumented = [
        n for n, info in model.model_fields.items() if not (info.description or "").strip()
    ]
    assert undocumented == []


@pytest.mark.parametrize("model", MODELS, ids=lambda m: m.__name__)
def test_models_are_frozen_and_strict_about_keys(model: type[pydantic.BaseModel]) -> None:
    assert model.model_config.get("frozen") is True
    assert model.model_config.get("extra") == "forbid"


def test_assignment_raises() -> None:
    cfg = DeepShardConfig.from_dict({"train_batch_size": 8, "zero_optimization": {"stage": 2}})
    with pytest.raises(pydantic.ValidationError, match="frozen"):
        cfg.train_batch_size = 16  # type: ignore[misc]
    with pytest.raises(pydantic.ValidationError, match="frozen"):
        cfg.zero_optimization.stage = 3  # type: ignore[misc]
    with pytest.raises(pydantic.ValidationError, match="frozen"):
        Topology(dp=2).dp = 4  # type: ignore[misc]


# Keys of DeepSpeed 0.19.7's DeepSpeedZeroConfig (runtime/zero/config.py) that DeepShard carries,
# with DeepSpeed's defaults, written as in a JSON config.
DEEPSPEED_ZERO_DEFAULTS: dict[str, Any] = {
    "stage": 0,
    "contiguous_gradients": True,
    "reduce_scatter": True,
    "reduce_bucket_size": 500_000_000,
    "use_multi_rank_bucket_allreduce": True,
    "allgather_partitions": True,
    "allgather_bucket_size": 500_000_000,
    "overlap_comm": False,
    "compute_grad_norm": True,
    "load_from_fp32_weights": True,
    "elastic_checkpoint": False,
    "offload_param": None,
    "offload_optimizer": None,
    "sub_group_size": 1_000_000_000,
    "stage3_prefetch_bucket_size": 50_000_000,
    "stage3_param_persistence_threshold": 100_000,
    "stage3_model_persistence_threshold": sys.maxsize,
    "stage3_max_live_parameters": 1_000_000_000,
    "stage3_max_reuse_distance": 1_000_000_000,
    "stage3_gather_16bit_weights_on_model_save": False,
    "stage3_module_granularity_threshold": 0,
    "stage3_use_all_reduce_for_fetch_params": False,
    "stage3_allgather_sequential": False,
    "ignore_unused_parameters": True,
    "round_robin_gradients": False,
    "parameter_alignment": False,
    "zero_hpz_partition_size": 1,
    "zero_quantized_weights": False,
    "zero_quantized_nontrainable_weights": False,
    "zero_quantized_gradients": False,
    "zeropp_loco_param": None,
    "memory_efficient_linear": True,
    "pipeline_loading_checkpoint": False,
    "override_module_apply": True,
    "log_trace_cache_warnings": False,
    "enable_sanity_checks": False,
    "save_muon_momentum_buffer_in_memory": False,
}


def test_zero_section_has_deepspeeds_keys_and_defaults() -> None:
    written = DeepShardConfig.from_dict({}).to_dict()["zero_optimization"]
    assert {k: written[k] for k in DEEPSPEED_ZERO_DEFAULTS} == DEEPSPEED_ZERO_DEFAULTS
    json_keys = {json_key(n, i) for n, i in ZeroConfig.model_fields.items()}
    assert json_keys - set(DEEPSPEED_ZERO_DEFAULTS) == {"leaf_module"}


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        ("gradient_clipping", 1.0),
        ("steps_per_print", None),
        ("gradient_allreduce_op", "mean"),
        ("zero_force_ds_cpu_optimizer", True),
        ("seq_parallel_communication_data_type", "fp32"),
        ("fp16.initial_scale_power", 16),
        ("fp16.loss_scale_window", 1000),
        ("fp16.hysteresis", 2),
        ("bf16.check_grad_overflow", True),
        ("bf16.immediate_grad_update", False),
        ("flops_profiler.top_modules", 1),
        ("flops_profiler.module_depth", -1),
        ("checkpoint.tag_validation", "WARN"),
        ("elasticity.max_train_batch_size", 2000),
        ("elasticity.micro_batch_sizes", [2, 4, 6]),
        ("aio.block_size", 1048576),
        ("tensor_parallel.autotp_size", 0),
    ],
)
def test_deepspeed_defaults(path: str, expected: Any) -> None:
    value: Any = DeepShardConfig.from_dict({})
    for part in path.split("."):
        value = getattr(value, part)
    assert value == expected


def test_accepted_keys_are_unique_within_each_model() -> None:
    for model in MODELS:
        keys = [k for n, i in model.model_fields.items() for k in accepted_keys(n, i)]
        assert len(keys) == len(set(keys)), model.__name__


def test_free_form_dicts_are_only_where_deepspeed_is_free_form() -> None:
    free = {
        f"{m.__name__}.{n}"
        for m in MODELS
        for n, i in m.model_fields.items()
        if get_origin(i.annotation) is dict and get_args(i.annotation)[1] is Any
    }
    assert free == {"OptimizerConfig.params", "SchedulerConfig.params"}
