"""Requests, results and the choice of the next token.

A request carries its own decoding settings and, when sampling, its own seed: each sampled row
draws from a ``torch.Generator`` that belongs to that request alone, so its tokens do not depend
on which other requests share its batch, on the batch size, or on the order of submission.

The logits of a sampled row are processed in the order Hugging Face ``generate`` uses:
temperature, then top-k, then top-p (nucleus: the smallest set of most likely tokens whose
probability reaches ``top_p``, always keeping the most likely one).
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

import torch

from deepshard.interface.errors import ConfigError

__all__ = ["GenerationRequest", "GenerationResult", "next_token", "process_logits"]


@dataclass(frozen=True)
class GenerationRequest:
    """One prompt to continue.

    Attributes:
        request_id: Unique id; results come back in request order with it.
        prompt: Token ids, no padding (at least one).
        max_new_tokens: Most tokens to generate (> 0).
        eos_token_id: Tokens that end the request (kept in the output when hit).
        do_sample: Sample instead of taking the most likely token.
        temperature: Divides the logits when sampling (> 0).
        top_k: Keep only the k most likely tokens when sampling.
        top_p: Keep the smallest set of tokens whose probability reaches p when sampling.
        seed: Seed of this request's own generator (``None``: a fresh nondeterministic one).
    """

    request_id: Hashable
    prompt: tuple[int, ...]
    max_new_tokens: int
    eos_token_id: tuple[int, ...] = ()
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None

    def __post_init__(self) -> None:
        problems = []
        if len(self.prompt) == 0:
            problems.append(("prompt", "must hold at least one token"))
        if self.max_new_tokens <= 0:
            problems.append(("max_new_tokens", f"must be > 0, got {self.max_new_tokens}"))
        if self.temperature <= 0:
            problems.append(("temperature", f"must be > 0, got {self.temperature}"))
        if self.top_k is not None and self.top_k <= 0:
            problems.append(("top_k", f"must be > 0 or None, got {self.top_k}"))
        if self.top_p is not None and not 0 < self.top_p <= 1:
            problems.append(("top_p", f"must be in (0, 1] or None, got {self.top_p}"))
        if problems:
            where = [(f"request {self.request_id!r}.{key}", text) for key, text in problems]
            raise ConfigError.from_problems(where)


@dataclass(frozen=True)
class GenerationResult:
    """What one request produced.

    Attributes:
        request_id: The request's id.
        tokens: Generated tokens only (the EOS token included when one was hit).
        finished_by_eos: Whether an EOS token ended it (else the token budget did).
    """

    request_id: Hashable
    tokens: tuple[int, ...]
    finished_by_eos: bool


def process_logits(logits: torch.Tensor, request: GenerationRequest) -> torch.Tensor:
    """Applies a sampled request's temperature, top-k and top-p to one row of logits.

    Args:
        logits: ``[vocab]`` float logits.
        request: Its settings.

    Returns:
        The processed logits; removed tokens are ``-inf``.
    """
    logits = logits.float() / request.temperature
    if request.top_k is not None and request.top_k < logits.numel():
        kth = torch.topk(logits, request.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if request.top_p is not None and request.top_p < 1.0:
        ordered, index = torch.sort(logits, descending=False)
        cumulative = ordered.softmax(dim=-1).cumsum(dim=-1)
        drop_sorted = cumulative <= 1 - request.top_p
        drop_sorted[-1] = False  # the most likely token always stays
        drop = drop_sorted.scatter(0, index, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def next_token(
    logits: torch.Tensor, request: GenerationRequest, generator: torch.Generator | None
) -> int:
    """Chooses one row's next token: argmax, or a draw from its own generator.

    Args:
        logits: ``[vocab]`` logits of the row's last position.
        request: The row's request.
        generator: The request's generator (used only when sampling).

    Returns:
        The token id.
    """
    if not request.do_sample:
        return int(torch.argmax(logits).item())
    probs = process_logits(logits, request).softmax(dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator).item())
