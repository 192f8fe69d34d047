"""A sampled row's logits are processed like Hugging Face ``generate`` processes them.

Temperature, top-k and top-p are compared with transformers' own warpers applied in the same
order on random logits; requests with out-of-range settings are refused with the field named.
"""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import (
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from deepshard.inference._sampling import GenerationRequest, next_token, process_logits
from deepshard.interface.errors import ConfigError


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p"),
    [(1.0, None, None), (0.7, 5, None), (1.3, None, 0.8), (0.9, 20, 0.6), (1.0, 1, 0.99)],
)
def test_processing_equals_hf_warpers(
    temperature: float, top_k: int | None, top_p: float | None
) -> None:
    logits = torch.randn(4, 64, generator=torch.Generator().manual_seed(0)) * 3
    expected = TemperatureLogitsWarper(temperature)(None, logits.clone())  # type: ignore[arg-type]
    if top_k is not None:
        expected = TopKLogitsWarper(top_k)(None, expected)  # type: ignore[arg-type]
    if top_p is not None:
        expected = TopPLogitsWarper(top_p)(None, expected)  # type: ignore[arg-type]
    request = GenerationRequest(
        0, (1,), 1, do_sample=True, temperature=temperature, top_k=top_k, top_p=top_p
    )
    ours = torch.stack([process_logits(row, request) for row in logits])
    assert torch.equal(torch.isinf(ours), torch.isinf(expected))
    kept = ~torch.isinf(ours)
    torch.testing.assert_close(ours[kept], expected[kept])


def test_next_token_greedy_and_seeded_draws() -> None:
    logits = torch.tensor([0.1, 2.0, 1.9, -1.0])
    assert next_token(logits, GenerationRequest(0, (1,), 1), None) == 1
    request = GenerationRequest(0, (1,), 1, do_sample=True, top_k=2)
    draws = [next_token(logits, request, torch.Generator().manual_seed(s)) for s in range(40)]
    assert set(draws) == {1, 2}  # top-2 only, both reachable
    again = [next_token(logits, request, torch.Generator().manual_seed(s)) for s in range(40)]
    assert again == draws


@pytest.mark.parametrize(
    ("field", "options"),
    [("prompt", {"prompt": ()}), ("max_new_tokens", {"max_new_tokens": 0}),
     ("max_new_tokens", {"max_new_tokens": -1}), ("temperature", {"temperature": 0.0}),
     ("top_k", {"top_k": 0}), ("top_p", {"top_p": 1.5})],
)  # fmt: skip
def test_bad_requests_are_refused(field: str, options: dict[str, object]) -> None:
    settings: dict[str, object] = {"request_id": "q", "prompt": (3,), "max_new_tokens": 2}
    with pytest.raises(ConfigError, match=f"request 'q'.{field}"):
        GenerationRequest(**(settings | options))  # type: ignore[arg-type]
