"""What a rollout decodes, and the decoding itself.

A `Sample` is one row to generate: its prompt, token budget, stop ids and seeded sampling.
`decode_samples` hands the samples to the continuous-batching loop
(`deepshard.inference._loop.generate_requests`) when the package has it; otherwise it decodes
them one at a time with the model's own Hugging Face cache (`decode_one`), which gives the same
tokens: each sample has its own generator and never depends on the other rows.

Token choice (`choose_token`): greedy is the arg-max of the last position's logits; sampling
divides them by the temperature, keeps the ``top_k`` largest, then the smallest set whose
probability reaches ``top_p`` (the most likely token always stays), and draws from the rest
with the sample's generator.
"""

from __future__ import annotations

import importlib
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch

__all__ = ["Sample", "choose_token", "decode_one", "decode_samples"]


@dataclass(frozen=True)
class Sample:
    """One row to generate.

    Attributes:
        sample_id: Unique within one call.
        prompt: Token ids.
        max_new_tokens: Most tokens to generate.
        eos_token_id: Ids that end the row (kept as its last token).
        do_sample: Sample (else greedy).
        temperature: Softmax temperature when sampling.
        top_k: Keep this many most likely tokens (None: all).
        top_p: Nucleus threshold (None: all).
        seed: The sample's generator seed.
    """

    sample_id: Hashable
    prompt: tuple[int, ...]
    max_new_tokens: int
    eos_token_id: tuple[int, ...]
    do_sample: bool
    temperature: float
    top_k: int | None
    top_p: float | None
    seed: int


def choose_token(logits: torch.Tensor, sample: Sample, generator: torch.Generator | None) -> int:
    """The next token from one position's ``[vocab]`` logits (see the module)."""
    if not sample.do_sample or generator is None:
        return int(torch.argmax(logits).item())
    scores = logits.detach().float().cpu() / sample.temperature
    if sample.top_k is not None and sample.top_k < scores.numel():
        kth = torch.topk(scores, sample.top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if sample.top_p is not None and sample.top_p < 1:
        ordered, order = torch.sort(scores, descending=True)
        before = torch.softmax(ordered, dim=-1).cumsum(-1) - torch.softmax(ordered, dim=-1)
        drop = before >= sample.top_p  # the mass before a token already reached top_p
        scores = scores.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator).item())


@torch.no_grad()
def decode_one(model: torch.nn.Module, sample: Sample, device: torch.device) -> tuple[int, ...]:
    """``sample``'s generated tokens (EOS included when hit), with the model's own cache."""
    generator = torch.Generator().manual_seed(sample.seed) if sample.do_sample else None
    ids = torch.tensor([sample.prompt], dtype=torch.long, device=device)
    out = model(input_ids=ids, use_cache=True)
    tokens: list[int] = []
    while True:
        token = choose_token(out.logits[0, -1], sample, generator)
        tokens.append(token)
        if token in sample.eos_token_id or len(tokens) == sample.max_new_tokens:
            return tuple(tokens)
        step = torch.tensor([[token]], dtype=torch.long, device=device)
        out = model(input_ids=step, past_key_values=out.past_key_values, use_cache=True)


def _loop_module() -> object | None:
    try:
        return importlib.import_module("deepshard.inference._loop")
    except ImportError:
        return None


def decode_samples(
    model: torch.nn.Module,
    samples: Sequence[Sample],
    *,
    max_batch_size: int,
    pad_token_id: int,
    kv_heads: int | None,
    device: torch.device,
) -> list[tuple[int, ...]]:
    """Every sample's generated tokens, in order (continuous batching when available)."""
    loop = _loop_module()
    if loop is None:
        return [decode_one(model, s, device) for s in samples]
    request_cls = getattr(loop, "GenerationRequest", None)
    if request_cls is None:
        request_cls = importlib.import_module("deepshard.inference._sampling").GenerationRequest
    requests = [
        request_cls(
            request_id=s.sample_id,
            prompt=s.prompt,
            max_new_tokens=s.max_new_tokens,
            eos_token_id=s.eos_token_id,
            do_sample=s.do_sample,
            temperature=s.temperature,
            top_k=s.top_k,
            top_p=s.top_p,
            seed=s.seed,
        )
        for s in samples
    ]
    results = loop.generate_requests(  # type: ignore[attr-defined]
        model, requests, max_batch_size=max_batch_size, pad_token_id=pad_token_id, kv_heads=kv_heads
    )
    return [tuple(r.tokens) for r in results]
