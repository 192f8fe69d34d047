"""``init_inference(enable_profiling=True)``: the engine's summary counts its generates, and
the tokens equal those of an engine without profiling.

One prompt of 3 tokens and 6 new tokens: one prefill forward gives the first token, one decode
forward each of the other 5, so the summary must say 1 prefill, 5 decode forwards, 6 tokens.
A second generate adds to the same counts.
"""

from __future__ import annotations

import torch

from deepshard.inference import init_inference
from deepshard.testing import import_beside

models = import_beside(__file__, "_batch_models.py")


def test_engine_profile_counts_and_never_changes_tokens() -> None:
    ids = torch.tensor([[5, 9, 2]])
    plain = init_inference(models.tiny_llama()).generate(ids, max_new_tokens=6, pad_token_id=0)
    assert init_inference(models.tiny_llama()).profile_summary() is None

    engine = init_inference(models.tiny_llama(), enable_profiling=True)
    profiled = engine.generate(ids, max_new_tokens=6, pad_token_id=0)
    assert torch.equal(profiled, plain) and profiled.shape == (1, 3 + 6)
    summary = engine.profile_summary()
    assert summary is not None
    assert (summary["prefill_forwards"], summary["decode_forwards"]) == (1, 6 - 1)
    assert summary["generated_tokens"] == 6

    engine.generate(ids, max_new_tokens=4, pad_token_id=0)
    again = engine.profile_summary()
    assert again is not None
    assert (again["prefill_forwards"], again["decode_forwards"]) == (2, 5 + 3)
    assert again["generated_tokens"] == 6 + 4
