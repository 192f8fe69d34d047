"""Continuous batching gives every request exactly what it gets alone.

Twelve requests of mixed prompt lengths (1-10) and budgets (1-12) go through
`generate_requests` with ``max_batch_size=4`` — rows retire and are refilled or compacted while
others decode — and each request's tokens equal Hugging Face ``generate`` run on that request
alone (greedy, its own dynamic cache), and equal the loop at batch size 1. EOS ids are taken
from those independent greedy outputs, so some requests stop early. Sampled requests with their
own seeds give the same tokens whatever the batch size and the order of submission. Under
``inference_mode=True`` (what `InferenceEngine` runs) the tokens are the same, the forwards run
in inference mode, and the model still trains afterwards (nothing it keeps became an inference
tensor).
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import pytest
import torch
from torch import nn

from deepshard.inference._loop import generate_requests
from deepshard.inference._sampling import GenerationRequest
from deepshard.testing import import_beside

models = import_beside(__file__, "_batch_models.py")
BUILDERS = {"llama": models.tiny_llama, "qwen3": models.tiny_qwen3}


def _tokens(results: list[Any]) -> dict[Any, tuple[int, ...]]:
    return {result.request_id: result.tokens for result in results}


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_greedy_equals_one_request_at_a_time_hf_generate(name: str) -> None:
    model = BUILDERS[name]()
    requests = models.mixed_requests(12, seed=3)
    alone = [models.hf_greedy(model, request) for request in requests]
    # Every third request stops at an EOS: its third greedy token (when it has one).
    requests = [
        dataclasses.replace(r, eos_token_id=(ref[2],)) if i % 3 == 0 and len(ref) > 3 else r
        for i, (r, ref) in enumerate(zip(requests, alone, strict=True))
    ]
    expected = {r.request_id: models.hf_greedy(model, r) for r in requests}
    assert len({len(r.prompt) for r in requests}) > 3 and len({len(t) for t in alone}) > 3
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the cached path: no fallback warning
        results = generate_requests(model, requests, max_batch_size=4, pad_token_id=0)
    assert [result.request_id for result in results] == [r.request_id for r in requests]
    assert _tokens(results) == expected
    for request, result in zip(requests, results, strict=True):
        stopped = bool(request.eos_token_id) and result.tokens[-1] in request.eos_token_id
        assert result.finished_by_eos == stopped
    assert sum(result.finished_by_eos for result in results) >= 2
    single = generate_requests(model, requests, max_batch_size=1, pad_token_id=0)
    assert _tokens(single) == expected


def test_inference_mode_gives_the_same_tokens_and_the_model_still_trains() -> None:
    model = models.tiny_llama()
    requests = models.mixed_requests(8, seed=5)
    sampled = [dataclasses.replace(r, do_sample=True, seed=i) for i, r in enumerate(requests)]
    modes: list[bool] = []
    model.register_forward_pre_hook(lambda *_: modes.append(torch.is_inference_mode_enabled()))
    plain = generate_requests(model, requests, max_batch_size=3, pad_token_id=0)
    assert modes and not any(modes)
    modes.clear()
    fast = generate_requests(model, requests, max_batch_size=3, pad_token_id=0, inference_mode=True)
    assert modes and all(modes)
    assert _tokens(fast) == _tokens(plain)
    drawn = [
        _tokens(
            generate_requests(model, sampled, max_batch_size=3, pad_token_id=0, inference_mode=m)
        )
        for m in (False, True)
    ]
    assert drawn[0] == drawn[1]
    ids = torch.tensor([list(requests[0].prompt)])
    model(input_ids=ids, labels=ids).loss.backward()  # a training step after: no inference tensor
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_seeded_sampling_does_not_depend_on_batch_mates(name: str) -> None:
    model = BUILDERS[name]()
    options = [{}, {"top_k": 5}, {"top_p": 0.8, "temperature": 0.7}, {"top_k": 20, "top_p": 0.9}]
    requests = [
        dataclasses.replace(r, do_sample=True, seed=100 + i, **options[i % 4])
        for i, r in enumerate(models.mixed_requests(12, seed=5))
    ]
    alone = _tokens(generate_requests(model, requests, max_batch_size=1, pad_token_id=0))
    batched = _tokens(generate_requests(model, requests, max_batch_size=4, pad_token_id=0))
    shuffled = [requests[i] for i in torch.randperm(12, generator=torch.Generator().manual_seed(0))]
    reordered = _tokens(generate_requests(model, shuffled, max_batch_size=4, pad_token_id=0))
    assert batched == alone and reordered == alone
    reseeded = [dataclasses.replace(r, seed=r.seed + 50) for r in requests]  # type: ignore[operator]
    other = _tokens(generate_requests(model, reseeded, max_batch_size=4, pad_token_id=0))
    assert other != alone  # the seed matters, so the equalities above are not vacuous
    greedy = {r.request_id: models.hf_greedy(model, r) for r in requests}
    assert alone != greedy


class _NoCacheLM(nn.Module):
    """A causal LM whose forward takes no past_key_values (generate delegates to HF)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> Any:
        return self.inner(input_ids=input_ids, attention_mask=attention_mask)

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        return self.inner.generate(*args, **kwargs)  # type: ignore[operator]


class _IgnoresCacheLM(_NoCacheLM):
    """Takes past_key_values but never hands it to the model (the cache stays unwritten)."""

    @property
    def config(self) -> Any:
        return self.inner.config

    def forward(  # type: ignore[override]
        self, input_ids: torch.Tensor, past_key_values: Any = None, **kwargs: Any
    ) -> Any:
        return self.inner(input_ids=input_ids)


@pytest.mark.parametrize("wrapper", [_NoCacheLM, _IgnoresCacheLM])
def test_models_that_cannot_take_the_cache_fall_back_to_their_generate(wrapper: type) -> None:
    inner = models.tiny_llama()
    requests = models.mixed_requests(3, seed=7)
    with pytest.warns(UserWarning, match=f"{wrapper.__name__} cannot use DeepShard's static KV"):
        results = generate_requests(wrapper(inner), requests, max_batch_size=2, pad_token_id=0)
    assert _tokens(results) == {r.request_id: models.hf_greedy(inner, r) for r in requests}


def test_duplicate_ids_and_bad_batch_sizes_are_refused() -> None:
    model = models.tiny_llama()
    request = GenerationRequest("same", (1, 2), 2)
    with pytest.raises(ValueError, match="'same' appears twice"):
        generate_requests(model, [request, request], max_batch_size=2, pad_token_id=0)
    with pytest.raises(ValueError, match="max_batch_size must be an integer > 0"):
        generate_requests(model, [request], max_batch_size=0, pad_token_id=0)
    assert generate_requests(model, [], max_batch_size=2, pad_token_id=0) == []
