"""`build_rollout`: a `RolloutEngine` that generates from the training engine's own weights.

*Co-located.* There is no second copy of the model: each ``generate`` enters the training
engine's ``generation_context(gather_units=...)`` (`GenerationSource`; `deepshard.engine`'s
engine has it), which switches to eval mode, bounds the stage-3 gathers, keeps the training
state and restores modes and random streams on exit, and decodes on the module it names by
continuous batching (`deepshard.inference._loop.generate_requests`, one request per sample). So
``sync_weights(step)`` copies nothing; it records the step the next rollouts use, and refuses
going back. A plain ``nn.Module`` works too (eval mode inside, its modes restored after).

This package cannot import ZeRO or AutoTP (they are its peers), so the source is typed by what
it provides (`GenerationSource`, `GenerationView`), not by class.

*Lockstep.* Under tensor parallelism every ``tp`` rank must call ``generate`` with the same
requests (each forward runs the layers' collectives); the tokens then agree on every rank,
seeded sampling included. At ZeRO stage 3 every data-parallel rank must call it too (a forward
gathers), with the same number of forwards: same requests, or at least the same lengths.

*Pad and EOS.* The tokenizer's ``pad_token_id``, else its (first) ``eos_token_id``; a tokenizer
with neither is refused, since response padding needs an id.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from deepshard.inference._loop import generate_requests
from deepshard.inference._rollout import (
    RolloutBatch,
    RolloutConfig,
    RolloutEngine,
    RolloutRequest,
    SamplingConfig,
    assemble_batch,
    sample_seed,
)
from deepshard.inference._sampling import GenerationRequest
from deepshard.interface.errors import ConfigError

__all__ = ["ColocatedRollout", "GenerationSource", "GenerationView", "build_rollout"]


class GenerationView(Protocol):
    """What a source's generation context yields."""

    @property
    def module(self) -> torch.nn.Module:
        """The model to run."""
        ...

    @property
    def kv_heads(self) -> int | None:
        """This rank's KV-head count under TP; ``None``: the model's config says."""
        ...


@runtime_checkable
class GenerationSource(Protocol):
    """A training engine that can generate from its own weights."""

    def generation_context(self, *, gather_units: int = 1) -> AbstractContextManager[Any]:
        """Enter to generate (yields a `GenerationView`); the training state is kept."""
        ...


@dataclass(frozen=True)
class _PlainView:
    module: torch.nn.Module
    kv_heads: int | None = None


@contextlib.contextmanager
def _plain_context(module: torch.nn.Module) -> Iterator[_PlainView]:
    modes = [(m, m.training) for m in module.modules()]
    module.eval()
    try:
        yield _PlainView(module)
    finally:
        for submodule, training in modes:
            submodule.training = training


def _token_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int) and not isinstance(value, bool):
        return (value,)
    return tuple(int(v) for v in value)


def special_tokens(tokenizer: Any) -> tuple[int, tuple[int, ...]]:
    """``(pad id, EOS ids)`` of ``tokenizer``: pad falls back to the first EOS id.

    Raises:
        ConfigError: The tokenizer has neither.
    """
    eos = _token_ids(getattr(tokenizer, "eos_token_id", None))
    pad = getattr(tokenizer, "pad_token_id", None)
    if pad is None and not eos:
        raise ConfigError(
            f"build_rollout: the tokenizer ({type(tokenizer).__name__}) has neither "
            "pad_token_id nor eos_token_id; set one (tokenizer.pad_token = tokenizer.eos_token, "
            "or add a pad token) so responses can be padded"
        )
    return (int(pad) if pad is not None else eos[0]), eos


class ColocatedRollout:
    """A `RolloutEngine` on the training engine's weights (see the module; build with
    `build_rollout`)."""

    def __init__(
        self, config: RolloutConfig, source: Any, *, pad_token_id: int, eos: tuple[int, ...]
    ) -> None:
        self.config = config
        self.pad_token_id, self.eos_token_id = pad_token_id, eos
        self._source = source
        self.weights_step: int | None = None
        """The step given to the last `sync_weights` (None before the first)."""
        self._closed = False

    def _context(self) -> AbstractContextManager[Any]:
        if isinstance(self._source, GenerationSource):
            return self._source.generation_context(gather_units=self.config.gather_units)
        return _plain_context(self._source)

    def _samples(
        self, requests: Sequence[RolloutRequest], sampling: SamplingConfig
    ) -> list[GenerationRequest]:
        seen: set[Any] = set()
        samples = []
        for position, request in enumerate(requests):
            if not isinstance(request, RolloutRequest):
                raise ConfigError(
                    f"rollout.generate: requests[{position}] is a {type(request).__name__}, "
                    "expected a RolloutRequest"
                )
            key = request.request_id if request.request_id is not None else ("#", position)
            if key in seen:
                raise ConfigError(
                    f"rollout.generate: request_id {request.request_id!r} appears twice; give "
                    "every request of one call its own id"
                )
            seen.add(key)
            base = request.seed if request.seed is not None else self.config.seed + position
            for j in range(sampling.n_samples_per_prompt):
                samples.append(
                    GenerationRequest(
                        request_id=(position, j),
                        prompt=request.prompt,
                        max_new_tokens=sampling.max_new_tokens,
                        eos_token_id=self.eos_token_id,
                        do_sample=sampling.do_sample,
                        temperature=float(sampling.temperature) if sampling.do_sample else 1.0,
                        top_k=sampling.top_k,
                        top_p=sampling.top_p,
                        seed=sample_seed(base, j),
                    )
                )
        return samples

    def generate(
        self, requests: Sequence[RolloutRequest], sampling: SamplingConfig | None = None
    ) -> RolloutBatch:
        """Every request completed ``n_samples_per_prompt`` times, rows repeated row-wise.

        Raises:
            ConfigError: After `shutdown`, with no requests, a repeated request id, or a
                request that is not a `RolloutRequest`.
        """
        if self._closed:
            raise ConfigError(
                "rollout.generate after shutdown(); build a new one with build_rollout"
            )
        if not requests:
            raise ConfigError("rollout.generate got no requests; pass at least one RolloutRequest")
        sampling = self.config.sampling if sampling is None else sampling
        if not isinstance(sampling, SamplingConfig):
            raise ConfigError(
                f"rollout.generate(sampling=...): expected a SamplingConfig, got {sampling!r}"
            )
        samples = self._samples(requests, sampling)
        with self._context() as view:
            results = generate_requests(
                view.module,
                samples,
                max_batch_size=sampling.continuous_batch_size,
                pad_token_id=self.pad_token_id,
                kv_heads=view.kv_heads,
            )
        prompts = [s.prompt for s in samples]
        responses = [r.tokens for r in results]
        return assemble_batch(prompts, responses, pad_token_id=self.pad_token_id)

    def sync_weights(self, step: int) -> None:
        """Record that rollouts now use step ``step``'s weights (they are the engine's own).

        Raises:
            ConfigError: ``step`` is not an int >= 0, or lower than the last one.
        """
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ConfigError(f"rollout.sync_weights(step={step!r}): expected an int >= 0")
        if self.weights_step is not None and step < self.weights_step:
            raise ConfigError(
                f"rollout.sync_weights(step={step}) after step {self.weights_step}: the "
                "co-located rollout generates from the current weights and cannot go back"
            )
        self.weights_step = step

    def shutdown(self) -> None:
        """Drop the reference to the training engine; ``generate`` refuses afterwards."""
        self._closed = True
        self._source = None


def build_rollout(
    config: RolloutConfig | Mapping[str, Any] | None, engine: Any, tokenizer: Any
) -> RolloutEngine:
    """A co-located `RolloutEngine` generating from ``engine``'s weights.

    Args:
        config: A `RolloutConfig`, a mapping of its fields, or None for the defaults.
        engine: The training engine (anything with ``generation_context``, such as
            `deepshard.engine.initialize`'s) or a plain ``torch.nn.Module``.
        tokenizer: Gives ``pad_token_id`` (else ``eos_token_id``) and the EOS ids.

    Raises:
        ConfigError: A bad config, an engine of another kind, or a tokenizer with neither a
            pad nor an EOS id.
    """
    built = RolloutConfig.build(config)
    if not isinstance(engine, GenerationSource | torch.nn.Module):
        raise ConfigError(
            f"build_rollout(engine=...): expected a training engine with generation_context() "
            f"(deepshard.engine.initialize's) or a torch.nn.Module, got {type(engine).__name__}"
        )
    pad, eos = special_tokens(tokenizer)
    return ColocatedRollout(built, engine, pad_token_id=pad, eos=eos)
