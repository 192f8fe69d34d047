"""`init_inference`'s config: token bounds, DeepSpeed spellings, kwargs/config overlap, refusals."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from deepshard.inference import InferenceConfig, init_inference
from deepshard.interface import ConfigError


def _tiny() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, vocab_size=32, max_position_embeddings=32,
    )  # fmt: skip
    return LlamaForCausalLM(config)


@pytest.mark.parametrize("value", [0, -1])
@pytest.mark.parametrize("key", ["max_out_tokens", "max_tokens"])
def test_max_out_tokens_must_be_positive(key: str, value: int) -> None:
    with pytest.raises(ConfigError) as caught:
        InferenceConfig(**{key: value})
    (path, message), *_ = caught.value.problems
    assert path in {"max_out_tokens", "max_tokens"} and "> 0" in message


def test_one_token_and_deepspeed_spellings_are_accepted() -> None:
    config = InferenceConfig(max_tokens=1, min_tokens=0, dtype=torch.bfloat16, mp_size=2)
    assert (config.max_out_tokens, config.min_out_tokens, config.dtype) == (1, 0, "bf16")
    assert config.tensor_parallel.tp_size == 2
    assert InferenceConfig(tp={"tp_size": 3}).tensor_parallel.size == 3
    assert (
        InferenceConfig(tensor_parallel={"tp_size": 3, "enabled": False}).tensor_parallel.size == 1
    )


@pytest.mark.parametrize(
    ("data", "path"),
    [
        ({"min_out_tokens": -1}, "min_tokens"),
        ({"min_out_tokens": 5, "max_out_tokens": 4}, "min_out_tokens"),
        ({"replace_with_kernel_inject": True}, "kernel_inject"),
        ({"mp_size": 2, "tensor_parallel": {"tp_size": 4}}, "mp_size"),
        ({"injection_policy": {}}, "injection_policy"),
        ({"max_tokens": 8, "max_out_tokens": 8}, "max_tokens"),
    ],
)
def test_invalid_configs_name_their_key(data: dict[str, object], path: str) -> None:
    with pytest.raises(ConfigError) as caught:
        InferenceConfig(**data)
    assert path in [problem[0] for problem in caught.value.problems]


def test_kwargs_and_config_overlap_only_when_equal() -> None:
    engine = init_inference(_tiny(), {"max_tokens": 16, "dtype": "fp32"}, max_out_tokens=16)
    assert engine.config.max_out_tokens == 16
    engine = init_inference(_tiny(), {"dtype": "fp16"}, dtype=torch.float16, min_out_tokens=2)
    assert engine.config.min_out_tokens == 2
    assert next(engine.module.parameters()).dtype == torch.float16
    assert not engine.module.training
    with pytest.raises(ConfigError) as caught:
        init_inference(_tiny(), {"max_tokens": 16}, max_out_tokens=17)
    assert caught.value.problems[0][0] == "max_out_tokens"
    with pytest.raises(ConfigError) as caught:
        init_inference(_tiny(), InferenceConfig(dtype="bf16"), dtype="fp16")
    assert caught.value.problems[0][0] == "dtype"


def test_tp_without_a_parallelizer_points_at_the_engine() -> None:
    with pytest.raises(ConfigError, match=r"deepshard\.engine\.init_inference"):
        init_inference(_tiny(), tensor_parallel={"tp_size": 2})


def test_cuda_graph_is_refused_with_a_reason() -> None:
    with pytest.raises(ConfigError) as caught:
        init_inference(_tiny(), enable_cuda_graph=True)
    assert caught.value.problems[0][0] == "enable_cuda_graph"
    if not torch.cuda.is_available():
        assert "CUDA device" in str(caught.value)


def test_generate_budget_is_bounded_by_max_out_tokens() -> None:
    engine = init_inference(_tiny(), max_out_tokens=6)
    ids = torch.tensor([[5, 6, 7, 8]])
    out = engine.generate(ids, max_new_tokens=2, pad_token_id=0, eos_token_id=[])
    assert out.shape == (1, 6) and torch.equal(out[:, :4], ids)
    assert engine.generate(ids, pad_token_id=0, eos_token_id=[]).shape == (1, 6)
    with pytest.raises(ConfigError, match="max_out_tokens"):
        engine.generate(ids, max_new_tokens=3, pad_token_id=0)
