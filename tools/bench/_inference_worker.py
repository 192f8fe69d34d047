"""The engines `inference.py` races: one tiny Llama, one list of requests, three ways to serve it.

Every engine gets the same seeded fp32 ``LlamaForCausalLM`` (built from a config, CPU, one
thread) and the same requests: a prompt of random token ids and a token budget each, all
arriving at time zero. Decoding is greedy and no request stops at EOS (the bench sets none), so
every request's answer is exactly its first ``max_new_tokens`` greedy tokens and the engines
can be compared token for token.

* ``deepshard-cb``: `deepshard.inference._loop.generate_requests` with ``max_batch_size`` B,
  which prefills each admitted request at its own length and retires a row the step its budget
  is spent, admitting the next request into the freed row.
* ``hf-static``: Hugging Face ``generate`` on static batches of B consecutive requests,
  left-padded; a batch runs until its longest budget is spent (every row decodes that many
  steps), and only each request's own budget counts as useful tokens.
* ``deepspeed-rollout``: DeepSpeed's ``HybridEngineRollout`` on a ``deepspeed.initialize``
  engine. Its continuous-batching prototype (``SamplingConfig.continuous_batch_size``) is tried
  first; where it refuses (transformers 5 dropped ``_supports_cache_class``) its default path,
  the model's ``generate`` on the same static batches with EOS ignored, is the row, and the
  refusal is reported.

Time to first token is measured the same way for every engine, by a forward hook on the model:
a forward whose input has more than one position is a prefill, and the requests it prefills
(its batch rows, admitted in FIFO order) have their first token when it returns.
"""

from __future__ import annotations

import os
import random
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch


@dataclass(frozen=True)
class Shape:
    """The model and the request mix of one bench size."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    requests: int
    prompt_range: tuple[int, int]
    new_tokens_range: tuple[int, int]

    def describe(self) -> str:
        """One line: the model and the request mix."""
        return (
            f"Llama hidden {self.hidden}, {self.layers} layers, {self.heads}/{self.kv_heads} "
            f"heads, vocab {self.vocab}; {self.requests} requests, prompts "
            f"{self.prompt_range[0]}-{self.prompt_range[1]} tokens, budgets "
            f"{self.new_tokens_range[0]}-{self.new_tokens_range[1]} new tokens"
        )


FULL = Shape(256, 688, 4, 8, 4, 2048, 32, (4, 96), (8, 96))
QUICK = Shape(64, 128, 2, 4, 2, 256, 32, (2, 24), (2, 24))
PAD = 0
"""The pad id: a token of the vocabulary; attention masks (and prefill at true length) hide it."""


@dataclass(frozen=True)
class Request:
    """One request of the mix: its prompt token ids (no padding) and its token budget."""

    prompt: tuple[int, ...]
    max_new_tokens: int


@dataclass(frozen=True)
class RunResult:
    """One engine's pass over all requests."""

    wall_s: float
    tokens: list[tuple[int, ...]]
    """Each request's generated tokens, cut to its own budget, in request order."""
    first_token_s: list[float]
    """Each request's time to first token, from the start of the pass."""
    forwards: int

    @property
    def useful_tokens(self) -> int:
        return sum(len(t) for t in self.tokens)

    @property
    def tokens_per_s(self) -> float:
        return self.useful_tokens / self.wall_s

    @property
    def ttft_mean_s(self) -> float:
        return statistics.fmean(self.first_token_s)

    @property
    def ttft_p50_s(self) -> float:
        return statistics.median(self.first_token_s)


def build_model(shape: Shape) -> torch.nn.Module:
    """The seeded tiny Llama (fp32, eval mode), the same weights on every call."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads, max_position_embeddings=512,
        pad_token_id=PAD, bos_token_id=None, eos_token_id=None, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = PAD
    module: torch.nn.Module = model
    return module.float().eval()


def build_requests(shape: Shape, seed: int = 0) -> list[Request]:
    """``shape.requests`` prompts and budgets drawn uniformly from the shape's ranges."""
    rng = random.Random(seed)
    requests = []
    for _ in range(shape.requests):
        length = rng.randint(*shape.prompt_range)
        prompt = tuple(rng.randrange(1, shape.vocab) for _ in range(length))
        requests.append(Request(prompt, rng.randint(*shape.new_tokens_range)))
    return requests


class PrefillClock:
    """A forward hook that stamps, per request in FIFO order, when its prefill returned."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.start = time.perf_counter()
        self.stamps: list[float] = []
        self.forwards = 0
        self._handle = model.register_forward_hook(self._after, with_kwargs=True)

    def _after(
        self, _module: Any, args: tuple[Any, ...], kwargs: dict[str, Any], _out: Any
    ) -> None:
        self.forwards += 1
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is None:
            ids = kwargs["inputs_embeds"]
        if ids.shape[1] > 1:
            self.stamps.extend([time.perf_counter() - self.start] * ids.shape[0])

    def close(self) -> None:
        """Removes the hook."""
        self._handle.remove()


def _left_padded(batch: Sequence[Request]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r.prompt) for r in batch)
    ids = torch.full((len(batch), width), PAD, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for row, request in enumerate(batch):
        ids[row, width - len(request.prompt) :] = torch.tensor(request.prompt)
        mask[row, width - len(request.prompt) :] = 1
    return ids, mask


def _timed(
    model: torch.nn.Module, requests: Sequence[Request], body: Callable[[], list[tuple[int, ...]]]
) -> RunResult:
    clock = PrefillClock(model)
    try:
        with torch.no_grad():
            tokens = body()
        wall = time.perf_counter() - clock.start
    finally:
        stamps = list(clock.stamps)
        clock.close()
    if len(stamps) != len(requests):
        raise RuntimeError(
            f"the prefill hook saw {len(stamps)} prefilled rows for {len(requests)} requests; the "
            "engine does not prefill one row per request, so time to first token is unattributed"
        )
    cut = [tuple(t[: r.max_new_tokens]) for t, r in zip(tokens, requests, strict=True)]
    return RunResult(wall, cut, stamps, clock.forwards)


def run_hf_static(model: torch.nn.Module, requests: Sequence[Request], batch: int) -> RunResult:
    """Hugging Face ``generate``, greedy, on static left-padded batches of ``batch`` requests."""

    def body() -> list[tuple[int, ...]]:
        out: list[tuple[int, ...]] = []
        for first in range(0, len(requests), batch):
            chunk = requests[first : first + batch]
            ids, mask = _left_padded(chunk)
            steps = max(r.max_new_tokens for r in chunk)
            generated = model.generate(  # type: ignore[operator]
                ids, attention_mask=mask, max_new_tokens=steps,
                do_sample=False, pad_token_id=PAD, eos_token_id=None,
            )  # fmt: skip
            out.extend(tuple(row.tolist()) for row in generated[:, ids.shape[1] :])
        return out

    return _timed(model, requests, body)


def run_deepshard(model: torch.nn.Module, requests: Sequence[Request], batch: int) -> RunResult:
    """DeepShard's continuous batching, greedy, ``max_batch_size=batch``, under
    ``torch.inference_mode()`` as `InferenceEngine.generate` runs it."""
    from deepshard.inference._loop import generate_requests
    from deepshard.inference._sampling import GenerationRequest

    asks = [GenerationRequest(i, r.prompt, r.max_new_tokens) for i, r in enumerate(requests)]

    def body() -> list[tuple[int, ...]]:
        results = generate_requests(
            model, asks, max_batch_size=batch, pad_token_id=PAD, inference_mode=True
        )
        if [r.request_id for r in results] != list(range(len(asks))):
            raise RuntimeError("generate_requests returned its results out of request order")
        return [tuple(r.tokens) for r in results]

    return _timed(model, requests, body)


def deepspeed_engine(model: torch.nn.Module) -> Any:
    """``deepspeed.initialize`` on one gloo rank (a FileStore, no ports), ZeRO stage 0."""
    import deepspeed
    import torch.distributed as dist

    for key, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1"}.items():
        os.environ.setdefault(key, value)
    if not dist.is_initialized():
        store = Path(tempfile.mkdtemp(prefix="infbench-ds-")) / "store"
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    deepspeed.init_distributed(dist_backend="gloo", dist_init_required=False)
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 0}}
    engine, *_ = deepspeed.initialize(model=model, config=config, dist_init_required=False)
    return engine


class _Tokenizer:
    """What ``HybridEngineRollout`` reads from a tokenizer: the pad and EOS ids."""

    pad_token_id = PAD
    eos_token_id = None


def run_deepspeed(
    engine: Any, requests: Sequence[Request], batch: int, continuous: bool
) -> RunResult:
    """DeepSpeed's rollout: its continuous-batching prototype, or its default static path."""
    from deepspeed.runtime.rollout import HybridEngineRollout, RolloutRequest, SamplingConfig

    rollout = HybridEngineRollout(engine=engine, tokenizer=_Tokenizer())

    def generate(chunk: Sequence[Request], size: int | None) -> list[tuple[int, ...]]:
        ids, mask = _left_padded(chunk)
        steps = max(r.max_new_tokens for r in chunk)
        sampling = SamplingConfig(max_new_tokens=steps, temperature=0.0, continuous_batch_size=size)
        out = rollout.generate(RolloutRequest(ids, mask), sampling)
        start = int(out.response_start_idx[0])
        return [tuple(row.tolist()) for row in out.input_ids[:, start:]]

    def body() -> list[tuple[int, ...]]:
        if continuous:
            return generate(requests, batch)
        out: list[tuple[int, ...]] = []
        for first in range(0, len(requests), batch):
            out.extend(generate(requests[first : first + batch], None))
        return out

    return _timed(engine.module, requests, body)


def mismatches(ours: RunResult, reference: RunResult) -> list[str]:
    """Requests whose tokens differ from the reference's, each with its first differing step."""
    bad = []
    for index, (a, b) in enumerate(zip(ours.tokens, reference.tokens, strict=True)):
        if a != b:
            step = next(
                (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                min(len(a), len(b)),
            )
            bad.append(f"request {index}: {len(a)} vs {len(b)} tokens, first difference at {step}")
    return bad
