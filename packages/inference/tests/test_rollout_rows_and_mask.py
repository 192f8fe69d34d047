"""Rollout batches: rows repeated row-wise, the response column, the mask rule, pad and EOS.

A tiny seeded ``LlamaForCausalLM`` (fp32, one process) completes 3 prompts of lengths 3, 5 and 2
with ``n_samples_per_prompt=2``. The greedy tokens are compared with Hugging Face's own
``generate`` of each prompt alone; the EOS id is the token that reference produces second for
prompt 0, so rows 0-1 stop early and show the padding and mask rule. Sampled rollouts give
distinct samples per prompt, the same rows on a second call, and the same rows whatever the
continuous batch size. Validation errors and the pad/EOS fallback are checked last.
"""

from __future__ import annotations

import re
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from deepshard.inference import (
    RolloutBatch,
    RolloutConfig,
    RolloutRequest,
    SamplingConfig,
    build_rollout,
)
from deepshard.interface.errors import ConfigError
from deepshard.testing import greedy_new_tokens

PROMPTS = ((5, 9, 2), (7, 1, 3, 3, 8), (11, 4))
NEW = 6


def _model() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        attention_dropout=0.1,
    )
    return LlamaForCausalLM(config)


def _hf_greedy(model: torch.nn.Module, prompt: tuple[int, ...], eos: int | None) -> list[int]:
    return greedy_new_tokens(
        model,
        torch.tensor([prompt]),
        max_new_tokens=NEW,
        eos_token_id=eos,
        pad_token_id=eos if eos is not None else 0,
    )


def _requests() -> list[RolloutRequest]:
    return [RolloutRequest(p, request_id=f"p{i}") for i, p in enumerate(PROMPTS)]


def test_rows_repeat_prompts_and_mask_follows_the_rule() -> None:
    model = _model()
    eos = _hf_greedy(model, PROMPTS[0], None)[1]
    want = [_hf_greedy(model, p, eos) for p in PROMPTS]
    assert len(want[0]) == 2 and all(len(w) >= 1 for w in want)
    tokenizer = SimpleNamespace(pad_token_id=None, eos_token_id=eos)  # pad falls back to EOS
    sampling = SamplingConfig(max_new_tokens=NEW, temperature=0, n_samples_per_prompt=2)
    model.train()
    batch = build_rollout({"sampling": sampling}, model, tokenizer).generate(_requests())
    assert model.training and all(m.training for m in model.modules())  # modes restored
    width = max(len(p) for p in PROMPTS)
    assert batch.response_start_idx == width
    assert batch.input_ids.shape == (6, width + max(len(w) for w in want))
    for row in range(6):
        prompt, response = PROMPTS[row // 2], want[row // 2]
        ids, mask = batch.input_ids[row].tolist(), batch.attention_mask[row].tolist()
        pad = width - len(prompt)
        assert ids[:pad] == [eos] * pad and ids[pad:width] == list(prompt)
        assert mask[:width] == [0] * pad + [1] * len(prompt)
        tail = ids[width:]
        assert tail[: len(response)] == response and set(tail[len(response) :]) <= {eos}
        assert mask[width:] == [int(t != eos) for t in tail]
    assert batch.attention_mask[0, width + 1] == 0  # the generated EOS counts as padding


def test_sampled_rows_are_seeded_per_sample() -> None:
    model = _model()
    tokenizer = SimpleNamespace(pad_token_id=0, eos_token_id=None)
    rollout = build_rollout({"seed": 3}, model, tokenizer)
    sampling = SamplingConfig(
        max_new_tokens=8, temperature=1.0, top_k=20, top_p=0.9, n_samples_per_prompt=2
    )
    first = rollout.generate(_requests(), sampling)
    again = rollout.generate(_requests(), sampling)
    one_by_one = rollout.generate(
        _requests(), SamplingConfig(**{**vars(sampling), "continuous_batch_size": 1})
    )
    assert torch.equal(first.input_ids, again.input_ids)
    assert torch.equal(first.input_ids, one_by_one.input_ids)
    for p in range(3):
        assert not torch.equal(first.responses[2 * p], first.responses[2 * p + 1])
    seeded = [RolloutRequest(p, request_id=i, seed=99) for i, p in enumerate(PROMPTS)]
    other = rollout.generate(seeded, sampling)
    assert not torch.equal(other.responses, first.responses)


@pytest.mark.parametrize(
    ("kwargs", "key"),
    [
        ({"max_new_tokens": 0}, "sampling.max_new_tokens"),
        ({"temperature": -0.5}, "sampling.temperature"),
        ({"top_p": 0.0}, "sampling.top_p"),
        ({"top_p": 1.5}, "sampling.top_p"),
        ({"top_k": 0}, "sampling.top_k"),
        ({"n_samples_per_prompt": 0}, "sampling.n_samples_per_prompt"),
        ({"continuous_batch_size": True}, "sampling.continuous_batch_size"),
    ],
)
def test_sampling_config_refuses(kwargs: dict[str, Any], key: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(key)):
        SamplingConfig(**kwargs)


def test_requests_configs_and_batches_are_validated() -> None:
    with pytest.raises(ConfigError, match="non-empty"):
        RolloutRequest(())
    with pytest.raises(ConfigError, match=re.escape("rollout.sampling.max_tokens")):
        RolloutConfig.build({"sampling": {"max_tokens": 3}})
    with pytest.raises(ConfigError, match=re.escape("rollout.gather_units")):
        RolloutConfig(gather_units=0)
    ids = torch.zeros(2, 4, dtype=torch.long)
    with pytest.raises(ConfigError, match="differs"):
        RolloutBatch(ids, torch.ones(2, 3, dtype=torch.long), 1)
    with pytest.raises(ConfigError, match="integer"):
        RolloutBatch(ids.float(), ids, 1)
    with pytest.raises(ConfigError, match="response_start_idx"):
        RolloutBatch(ids, ids, 5)
    rollout = build_rollout(None, _model(), SimpleNamespace(pad_token_id=0, eos_token_id=1))
    with pytest.raises(ConfigError, match="twice"):
        rollout.generate(
            [RolloutRequest((1,), request_id="a"), RolloutRequest((2,), request_id="a")]
        )
    rollout.sync_weights(2)
    with pytest.raises(ConfigError, match="cannot go back"):
        rollout.sync_weights(1)
    rollout.shutdown()
    with pytest.raises(ConfigError, match="shutdown"):
        rollout.generate(_requests())


def test_pad_falls_back_to_eos_and_neither_is_refused() -> None:
    model = _model()
    assert (
        build_rollout(
            None, model, SimpleNamespace(pad_token_id=None, eos_token_id=[7, 9])
        ).pad_token_id
        == 7
    )  # type: ignore[attr-defined]
    assert (
        build_rollout(None, model, SimpleNamespace(pad_token_id=3, eos_token_id=7)).pad_token_id
        == 3
    )  # type: ignore[attr-defined]
    with pytest.raises(ConfigError, match="neither pad_token_id nor eos_token_id"):
        build_rollout(None, model, SimpleNamespace(pad_token_id=None, eos_token_id=None))
    with pytest.raises(ConfigError, match="engine"):
        build_rollout(None, object(), SimpleNamespace(pad_token_id=0))
