"""Invalid configs fail with ConfigError naming the DeepSpeed key path, the value and the fix."""

from __future__ import annotations

import pickle
from typing import Any

import pytest

from deepshard.interface import ConfigError, DeepShardConfig
from deepshard.interface.config import OffloadOptimizerConfig, ZeroConfig


def _problems(raw: dict[str, Any]) -> dict[str, str]:
    with pytest.raises(ConfigError) as info:
        DeepShardConfig.from_dict(raw)
    return dict(info.value.problems)


@pytest.mark.parametrize(
    ("raw", "path", "suggestion"),
    [
        (
            {"zero_optimization": {"reduce_bucket_sise": 1}},
            "zero_optimization.reduce_bucket_sise",
            "reduce_bucket_size",
        ),
        ({"gradient_clippin": 1.0}, "gradient_clippin", "gradient_clipping"),
        (
            {"zero_optimization": {"stage3_prefetch_bucket_sz": 1}},
            "zero_optimization.stage3_prefetch_bucket_sz",
            "stage3_prefetch_bucket_size",
        ),
        (
            {
                "zero_optimization": {
                    "offload_param": {"device": "cpu", "pin_memroy": True},
                    "stage": 3,
                }
            },
            "zero_optimization.offload_param.pin_memroy",
            "pin_memory",
        ),
        ({"bfloat16": {"enable": True}}, "bf16.enable", "enabled"),
    ],
)
def test_misspelled_key_gets_its_path_and_the_nearest_key(
    raw: dict[str, Any], path: str, suggestion: str
) -> None:
    problems = _problems(raw)
    assert problems[path] == f"unknown key; did you mean {suggestion!r}?"


def test_unknown_key_without_a_near_match_lists_the_small_section() -> None:
    problems = _problems({"timers": {"throughput": {"zzz": 1}}})
    assert problems["timers.throughput.zzz"] == "unknown key; accepted keys: enabled, synchronized"


def test_wrong_type_names_path_and_value() -> None:
    problems = _problems({"zero_optimization": {"overlap_comm": "maybe"}})
    message = problems["zero_optimization.overlap_comm"]
    assert "valid boolean" in message and message.endswith("got 'maybe'")


def test_section_given_as_a_scalar() -> None:
    problems = _problems({"fp16": 3})
    assert problems["fp16"] == "expected a JSON object (a section of keys); got 3"


@pytest.mark.parametrize(
    ("raw", "path", "expected"),
    [
        (
            {"zero_optimization": {"reduce_bucket_size": 0}},
            "zero_optimization.reduce_bucket_size",
            "must be > 0; got 0",
        ),
        ({"gradient_clipping": -1.0}, "gradient_clipping", "must be >= 0.0; got -1.0"),
        (
            {"zero_optimization": {"offload_optimizer": {"ratio": 1.5}}},
            "zero_optimization.offload_optimizer.ratio",
            "must be <= 1.0; got 1.5",
        ),
        (
            {"elasticity": {"micro_batch_sizes": [2, 0]}},
            "elasticity.micro_batch_sizes[1]",
            "must be > 0; got 0",
        ),
    ],
)
def test_out_of_range_names_the_bound(raw: dict[str, Any], path: str, expected: str) -> None:
    assert _problems(raw)[path] == expected


@pytest.mark.parametrize(
    ("raw", "path", "allowed"),
    [
        ({"zero_optimization": {"stage": 4}}, "zero_optimization.stage", "0, 1, 2 or 3"),
        (
            {"zero_optimization": {"offload_param": {"device": "gpu"}}},
            "zero_optimization.offload_param.device",
            "'none', 'cpu' or 'nvme'",
        ),
        ({"gradient_allreduce_op": "max"}, "gradient_allreduce_op", "'mean' or 'sum'"),
        (
            {"checkpoint": {"tag_validation": "Maybe"}},
            "checkpoint.tag_validation",
            "'WARN', 'IGNORE' or 'FAIL'",
        ),
        (
            {"data_types": {"grad_accum_dtype": "int4"}},
            "data_types.grad_accum_dtype",
            "'fp32', 'fp16' or 'bf16'",
        ),
    ],
)
def test_literal_violation_lists_the_accepted_values(
    raw: dict[str, Any], path: str, allowed: str
) -> None:
    assert _problems(raw)[path].startswith(f"expected one of {allowed}; got ")


def test_every_problem_is_reported_at_once() -> None:
    problems = _problems(
        {
            "fp16": {"enabled": True, "hysteresis": 0},
            "zero_optimization": {"stage": 9},
            "wandb": {"projet": "x"},
        }
    )
    assert set(problems) == {"fp16.hysteresis", "zero_optimization.stage", "wandb.projet"}


def test_message_lists_one_line_per_problem() -> None:
    with pytest.raises(ConfigError) as info:
        DeepShardConfig.from_dict({"aio": {"queue_depth": 0, "intra_op_parallelism": 0}})
    lines = str(info.value).splitlines()
    assert lines[0] == "2 problems in the DeepShard config:"
    assert sorted(lines[1:]) == [
        "  - aio.intra_op_parallelism: must be >= 1; got 0",
        "  - aio.queue_depth: must be >= 1; got 0",
    ]


def test_boolean_where_a_number_belongs_is_refused() -> None:
    problems = _problems({"zero_optimization": {"stage3_max_live_parameters": True}})
    assert (
        problems["zero_optimization.stage3_max_live_parameters"]
        == "expected a number, got the boolean True"
    )


def test_one_setting_under_two_spellings_is_refused() -> None:
    problems = _problems({"bf16": {"enabled": True}, "bfloat16": {"enabled": False}})
    assert problems["bf16"] == "given twice, as 'bf16' and 'bfloat16'; keep only one"
    nested = _problems(
        {"zero_optimization": {"stage3_max_live_parameters": 1, "max_live_parameters": 2}}
    )
    assert "given twice" in nested["zero_optimization.stage3_max_live_parameters"]


@pytest.mark.parametrize(
    ("raw", "path", "fragment"),
    [
        (
            {"fp16": {"enabled": True}, "bf16": {"enabled": True}},
            "bf16.enabled",
            "cannot both be enabled",
        ),
        (
            {"gradient_allreduce_op": "sum", "zero_optimization": {"stage": 3}},
            "gradient_allreduce_op",
            "not supported with ZeRO stage 3",
        ),
        (
            {"zero_optimization": {"stage": 3, "compute_grad_norm": False}},
            "zero_optimization.compute_grad_norm",
            "stage 1 or 2",
        ),
        (
            {
                "zero_optimization": {
                    "stage": 2,
                    "offload_optimizer": {"device": "cpu", "ratio": 0.5},
                }
            },
            "zero_optimization.offload_optimizer.ratio",
            "needs stage 3",
        ),
        (
            {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme"}}},
            "zero_optimization.offload_optimizer.nvme_path",
            "needs nvme_path",
        ),
        (
            {"bf16": {"bf16_optimizer_states": True}},
            "bf16.bf16_optimizer_states",
            "bf16_master_weights_and_grads",
        ),
        (
            {"moe": {"ep_size": 4, "num_experts": 6}},
            "moe.num_experts",
            "not a multiple of ep_size 4",
        ),
        (
            {
                "moe": {"ep_size": 2, "num_experts": 8},
                "expert_parallel": {"enabled": True, "autoep_size": 4},
            },
            "moe.ep_size",
            "disagrees with expert_parallel.autoep_size 4",
        ),
        (
            {"elasticity": {"enabled": True}},
            "elasticity.max_train_batch_size",
            "required when elasticity",
        ),
        (
            {
                "curriculum_learning": {
                    "enabled": True,
                    "min_difficulty": 8,
                    "max_difficulty": 64,
                    "schedule_type": "fixed_root",
                }
            },
            "curriculum_learning.schedule_config.root_degree",
            "required by fixed_root",
        ),
    ],
)
def test_rules_across_keys_name_the_key_to_change(
    raw: dict[str, Any], path: str, fragment: str
) -> None:
    assert fragment in _problems(raw)[path]


def test_sections_built_directly_raise_config_error_with_their_path() -> None:
    with pytest.raises(ConfigError) as info:
        ZeroConfig(stage=2, reduce_bucket_sise=3)
    assert info.value.problems == [
        ("zero_optimization.reduce_bucket_sise", "unknown key; did you mean 'reduce_bucket_size'?")
    ]
    with pytest.raises(ConfigError, match=r"^zero_optimization\.offload_optimizer\.device: "):
        OffloadOptimizerConfig(device="disk")


def test_config_error_survives_pickling() -> None:
    with pytest.raises(ConfigError) as info:
        DeepShardConfig.from_dict({"fp16": {"enabled": True, "hysteresis": 0}})
    clone = pickle.loads(pickle.dumps(info.value))
    assert (str(clone), clone.problems) == (str(info.value), info.value.problems)


def test_non_dict_config_is_refused() -> None:
    with pytest.raises(ConfigError, match="must be a dict"):
        DeepShardConfig.from_dict([1, 2])  # type: ignore[arg-type]


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_param_offload_below_stage3_is_ignored_as_deepspeed_ignores_it(stage: int) -> None:
    """DeepSpeed-Chat writes offload_param at stage 2; DeepSpeed reads it at stage 3 only."""
    raw = {"zero_optimization": {"stage": stage, "offload_param": {"device": "cpu"}}}
    with pytest.warns(UserWarning, match=f"offload_param has no effect at stage {stage}"):
        config = DeepShardConfig.from_dict(raw)
    assert config.zero_optimization.offload_param is None
    assert raw["zero_optimization"]["offload_param"] == {"device": "cpu"}  # caller's dict kept
    with pytest.raises(ConfigError, match=r"offload_param\.pin_memroy"):  # mistakes still named
        DeepShardConfig.from_dict(
            {"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu", "pin_memroy": 1}}}
        )
    with pytest.raises(ConfigError, match=r"offload_param\.device"):  # still validated first
        DeepShardConfig.from_dict(
            {"zero_optimization": {"stage": 2, "offload_param": {"device": "gpu"}}}
        )


@pytest.mark.parametrize(
    ("raw", "path", "fragment"),
    [
        (
            {"optimizer": {"type": "AdamW", "adam_w_mode": True, "params": {"lr": 1e-3}}},
            "optimizer.adam_w_mode",
            'optimizer arguments go inside optimizer.params ("params": {"adam_w_mode": ...})',
        ),
        (
            {
                "curriculum_learning": {
                    "enabled": True,
                    "curriculum_type": "seqlen",
                    "min_difficulty": 8,
                    "max_difficulty": 64,
                    "schedule_type": "fixed_linear",
                    "schedule_config": {"total_step": 100, "difficulty_step": 8},
                }
            },
            "curriculum_learning.schedule_config.total_step",
            "did you mean 'total_curriculum_step'?",
        ),
    ],
)
def test_misplaced_keys_say_where_they_belong(
    raw: dict[str, Any], path: str, fragment: str
) -> None:
    assert fragment in _problems(raw)[path]
