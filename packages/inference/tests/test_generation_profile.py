"""Profiling counts what the loop did and never changes what it generates.

One request alone: one prefill forward gives the first token, then one decode forward per
further token, so decode forwards = new tokens - 1. For a continuous batch the counts follow
from the requests alone: requests admitted in the same step share one prefill forward (the
first step admits ``max_batch_size`` of them at once, so at most ``len - (max_batch_size - 1)``
prefill forwards, and at least one per ``max_batch_size`` requests), every request's tokens are
counted once, and at least as many decode forwards as the longest request needs.
"""

from __future__ import annotations

import math

from deepshard.inference._loop import generate_requests
from deepshard.inference._profile import GenerationProfile
from deepshard.inference._sampling import GenerationRequest
from deepshard.testing import import_beside

models = import_beside(__file__, "_batch_models.py")
KEYS = {
    "prefill_forwards", "decode_forwards", "generated_tokens", "prefill_s", "decode_s",
    "tokens_per_s", "scheduler_s", "cache_s", "time_to_first_token_s", "total_s", "requests",
}  # fmt: skip


def test_one_request_counts_and_keys() -> None:
    model = models.tiny_llama()
    profile = GenerationProfile()
    request = GenerationRequest("only", (5, 9, 2), max_new_tokens=7)
    (result,) = generate_requests(
        model, [request], max_batch_size=1, pad_token_id=0, profile=profile
    )
    summary = profile.summary()
    assert set(summary) >= KEYS
    assert summary["prefill_forwards"] == 1 and summary["requests"] == 1
    assert summary["generated_tokens"] == len(result.tokens) == 7
    assert summary["decode_forwards"] == 7 - 1
    for key in ["prefill_s", "decode_s", "scheduler_s", "cache_s", "time_to_first_token_s"]:
        assert 0 < summary[key] < summary["total_s"], key
    assert summary["prefill_s"] + summary["decode_s"] < summary["total_s"]
    assert math.isclose(summary["tokens_per_s"], 7 / summary["total_s"])


def test_profiling_never_changes_outputs() -> None:
    model = models.tiny_qwen3()
    greedy = models.mixed_requests(6, seed=11)
    sampled = [
        GenerationRequest(f"s{i}", r.prompt, r.max_new_tokens, do_sample=True, top_k=8, seed=i)
        for i, r in enumerate(models.mixed_requests(6, seed=12))
    ]
    requests = greedy + sampled
    plain = generate_requests(model, requests, max_batch_size=4, pad_token_id=0)
    profile = GenerationProfile()
    profiled = generate_requests(model, requests, max_batch_size=4, pad_token_id=0, profile=profile)
    assert profiled == plain
    summary = profile.summary()
    assert summary["requests"] == len(requests)
    assert math.ceil(len(requests) / 4) <= summary["prefill_forwards"] <= len(requests) - 3
    assert summary["generated_tokens"] == sum(len(r.tokens) for r in plain)
    longest = max(len(r.tokens) for r in plain)
    assert longest - 1 <= summary["decode_forwards"] < summary["generated_tokens"]
