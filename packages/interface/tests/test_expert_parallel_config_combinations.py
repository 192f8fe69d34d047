"""`expert_parallel`: DeepEP and combine settings that cannot work together fail at config time.

Each error names the key and the way out; the expert count (known once the model is) is
checked by `ExpertParallelConfig.check_num_experts`.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest

from deepshard.interface.config import DeepShardConfig, ExpertParallelConfig
from deepshard.interface.errors import ConfigError

DEEPEP_INSTALLED = importlib.util.find_spec("deep_ep") is not None


def _problems(section: dict[str, Any]) -> list[tuple[str, str]]:
    with pytest.raises(ConfigError) as caught:
        DeepShardConfig.from_dict({"expert_parallel": section})
    return caught.value.problems


@pytest.mark.parametrize(
    ("section", "key", "words"),
    [
        (
            {"combine_impl": "fused_weighted_sum", "score_apply": "pre"},
            "expert_parallel.combine_impl",
            "score_apply post",
        ),
        (
            {"comm_backend": "deepep", "comm_max_tokens_per_rank": 4096,
             "expert_tensor_parallel_size": 2},
            "expert_parallel.comm_backend",
            "expert tensor parallelism",
        ),
        (
            {"comm_backend": "deepep"},
            "expert_parallel.comm_max_tokens_per_rank",
            "must be > 0 with DeepEP",
        ),
        (
            {"num_expert_groups": 2, "num_limited_groups": 3},
            "expert_parallel.num_limited_groups",
            "exceeds num_expert_groups 2",
        ),
    ],
)  # fmt: skip
def test_contradictions_name_the_key(section: dict[str, Any], key: str, words: str) -> None:
    problems = dict(_problems(section))
    assert key in problems and words in problems[key]


@pytest.mark.skipif(DEEPEP_INSTALLED, reason="DeepEP is installed here")
def test_deepep_without_deep_ep_says_it_is_not_installed() -> None:
    section = {"enabled": True, "comm_backend": "deepep", "comm_max_tokens_per_rank": 4096}
    problems = dict(_problems(section))
    assert "DeepEP is not installed" in problems["expert_parallel.comm_backend"]
    # Disabled, the section is only parsed: the environment is not asked.
    parsed = DeepShardConfig.from_dict({"expert_parallel": {**section, "enabled": False}})
    assert parsed.expert_parallel.comm_backend == "deepep"


def test_valid_sections_parse() -> None:
    fused = ExpertParallelConfig(combine_impl="fused_weighted_sum", score_apply="post")
    assert fused.combine_impl == "fused_weighted_sum"
    assert ExpertParallelConfig().comm_max_tokens_per_rank == 0
    assert ExpertParallelConfig(num_expert_groups=4, num_limited_groups=2).num_limited_groups == 2


def test_autoep_size_and_groups_must_divide_the_experts() -> None:
    section = ExpertParallelConfig(enabled=True, autoep_size=4, num_expert_groups=3)
    with pytest.raises(ConfigError) as caught:
        section.check_num_experts(10, layer="model.layers.1.mlp")
    problems = dict(caught.value.problems)
    assert (
        "does not divide the 10 experts of model.layers.1.mlp"
        in problems["expert_parallel.autoep_size"]
    )
    assert "expert_parallel.num_expert_groups" in problems
    section.check_num_experts(12)  # 4 and 3 divide 12
    ExpertParallelConfig(autoep_size=4).check_num_experts(6)  # disabled: ep is 1
