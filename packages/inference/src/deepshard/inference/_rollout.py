"""Rollouts for a trainer: what is asked for, how it is sampled, and the batch that comes back.

An RL or on-policy distillation trainer asks for completions of a list of prompts
(`RolloutRequest`) under one `SamplingConfig` and trains on the `RolloutBatch` it gets back.

*Rows.* Each prompt yields ``n_samples_per_prompt`` rows, repeated row-wise: prompt 0's samples,
then prompt 1's, and so on. Sample ``j`` of a prompt draws from its own generator, seeded from
the request's seed (or the rollout's seed and the prompt's position when the request has none)
and ``j`` (`sample_seed`), so samples differ from each other and never depend on which other
rows share a decode batch.

*Layout.* Prompts are left-padded to the longest prompt ``P`` and responses right-padded to the
longest response, so every response starts at column ``response_start_idx = P``. The attention
mask is the prompt mask (1 on prompt tokens, 0 on the left padding) before ``P`` and
``token != pad`` from ``P`` on: where the pad id falls back to EOS, a generated EOS is masked
like padding.

The `RolloutEngine` protocol is what a trainer holds; `build_rollout`
(`deepshard.inference._rollout_colocated`) builds the implementation that generates from the
training engine's own weights.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any, Protocol, runtime_checkable

import torch

from deepshard.interface.errors import ConfigError

__all__ = [
    "RolloutBatch",
    "RolloutConfig",
    "RolloutEngine",
    "RolloutRequest",
    "SamplingConfig",
    "assemble_batch",
    "sample_seed",
]

_MASK64 = (1 << 64) - 1


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class RolloutRequest:
    """One prompt to complete.

    Attributes:
        prompt: Its token ids (no padding), at least one.
        request_id: A name unique within one ``generate`` call (the caller's bookkeeping).
        seed: Seeds its samples' generators; ``None`` derives one from the rollout's seed and
            the prompt's position in the call.
    """

    prompt: tuple[int, ...]
    request_id: Hashable = None
    seed: int | None = None

    def __post_init__(self) -> None:
        prompt = tuple(self.prompt)
        if not prompt or not all(_is_int(t) and t >= 0 for t in prompt):
            raise ConfigError(
                f"RolloutRequest({self.request_id!r}).prompt: expected a non-empty sequence of "
                f"token ids >= 0, got {self.prompt!r}"
            )
        object.__setattr__(self, "prompt", prompt)
        if self.seed is not None and not _is_int(self.seed):
            raise ConfigError(
                f"RolloutRequest({self.request_id!r}).seed: expected an int or None, got "
                f"{self.seed!r}"
            )


def _check_positive_int(name: str, value: Any) -> None:
    if not _is_int(value) or value < 1:
        raise ConfigError.from_problems(
            [(f"sampling.{name}", f"expected an int >= 1, got {value!r}")]
        )


@dataclass(frozen=True)
class SamplingConfig:
    """How each prompt is sampled.

    Attributes:
        max_new_tokens: Most tokens generated per row (EOS ends a row earlier), >= 1.
        temperature: Softmax temperature, >= 0; 0 is greedy decoding (top_p/top_k unused).
        top_p: Nucleus sampling: keep the smallest set of tokens whose probability reaches
            ``top_p``, in (0, 1]; ``None`` keeps all.
        top_k: Keep the ``top_k`` most likely tokens, >= 1; ``None`` keeps all.
        n_samples_per_prompt: Rows per prompt, >= 1.
        continuous_batch_size: Most rows decoded together by continuous batching, >= 1.
    """

    max_new_tokens: int = 16
    temperature: float = 1.0
    top_p: float | None = None
    top_k: int | None = None
    n_samples_per_prompt: int = 1
    continuous_batch_size: int = 8

    def __post_init__(self) -> None:
        for name in ("max_new_tokens", "n_samples_per_prompt", "continuous_batch_size"):
            _check_positive_int(name, getattr(self, name))
        if self.top_k is not None:
            _check_positive_int("top_k", self.top_k)
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, int | float) or not t >= 0:
            raise ConfigError.from_problems(
                [("sampling.temperature", f"expected a number >= 0 (0: greedy), got {t!r}")]
            )
        p = self.top_p
        if p is not None and (
            isinstance(p, bool) or not isinstance(p, int | float) or not 0 < p <= 1
        ):
            raise ConfigError.from_problems(
                [("sampling.top_p", f"expected a number in (0, 1] or None, got {p!r}")]
            )

    @property
    def do_sample(self) -> bool:
        """Whether tokens are sampled (temperature > 0) rather than chosen greedily."""
        return self.temperature > 0


def _from_mapping(cls: type, values: Mapping[str, Any], where: str) -> dict[str, Any]:
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ConfigError.from_problems(
            [(f"{where}.{k}", f"unknown key; expected one of {sorted(known)}") for k in unknown]
        )
    return dict(values)


@dataclass(frozen=True)
class RolloutConfig:
    """How `build_rollout` generates.

    Attributes:
        sampling: What ``generate`` uses when it is given no `SamplingConfig`.
        gather_units: At ZeRO stage 3, most units gathered at once while generating
            (DeepSpeed's ``tp_gather_partition_size``), >= 1.
        seed: Base of the seeds of requests that bring none.
    """

    sampling: SamplingConfig = SamplingConfig()
    gather_units: int = 1
    seed: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.sampling, Mapping):
            values = _from_mapping(SamplingConfig, self.sampling, "rollout.sampling")
            object.__setattr__(self, "sampling", SamplingConfig(**values))
        if not isinstance(self.sampling, SamplingConfig):
            raise ConfigError.from_problems(
                [
                    (
                        "rollout.sampling",
                        f"expected a SamplingConfig or a mapping, got {self.sampling!r}",
                    )
                ]
            )
        if not _is_int(self.gather_units) or self.gather_units < 1:
            raise ConfigError.from_problems(
                [("rollout.gather_units", f"expected an int >= 1, got {self.gather_units!r}")]
            )
        if not _is_int(self.seed):
            raise ConfigError.from_problems(
                [("rollout.seed", f"expected an int, got {self.seed!r}")]
            )

    @classmethod
    def build(cls, config: RolloutConfig | Mapping[str, Any] | None) -> RolloutConfig:
        """``config`` as a `RolloutConfig` (a mapping's keys are the fields; None: defaults)."""
        if config is None:
            return cls()
        if isinstance(config, RolloutConfig):
            return config
        if isinstance(config, Mapping):
            return cls(**_from_mapping(cls, config, "rollout"))
        raise ConfigError(
            f"build_rollout(config=...): expected a RolloutConfig, a mapping or None, got "
            f"{type(config).__name__}"
        )


def _integer_2d(name: str, value: Any) -> torch.Tensor:
    if not isinstance(value, torch.Tensor) or value.dim() != 2:
        got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        raise ConfigError(f"RolloutBatch.{name}: expected a 2-d tensor [rows, length], got {got}")
    if value.is_floating_point() or value.is_complex():
        raise ConfigError(f"RolloutBatch.{name}: expected an integer tensor, got {value.dtype}")
    return value


@dataclass(frozen=True)
class RolloutBatch:
    """Prompts and their responses, one row per sample (see the module for the layout).

    Attributes:
        input_ids: ``[rows, length]`` integer token ids: left-padded prompt, then response.
        attention_mask: ``[rows, length]``, same shape, integer or bool.
        response_start_idx: The column where every response begins (the longest prompt).
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    response_start_idx: int

    def __post_init__(self) -> None:
        ids = _integer_2d("input_ids", self.input_ids)
        mask = _integer_2d("attention_mask", self.attention_mask)
        if mask.shape != ids.shape:
            raise ConfigError(
                f"RolloutBatch.attention_mask: shape {tuple(mask.shape)} differs from "
                f"input_ids' {tuple(ids.shape)}; they must match"
            )
        start = self.response_start_idx
        if not _is_int(start) or not 0 <= start <= ids.shape[1]:
            raise ConfigError(
                f"RolloutBatch.response_start_idx: expected an int in [0, {ids.shape[1]}], "
                f"got {start!r}"
            )

    @property
    def responses(self) -> torch.Tensor:
        """The response columns of `input_ids`."""
        return self.input_ids[:, self.response_start_idx :]


@runtime_checkable
class RolloutEngine(Protocol):
    """What a trainer holds to get rollouts."""

    def generate(
        self, requests: Sequence[RolloutRequest], sampling: SamplingConfig | None = None
    ) -> RolloutBatch:
        """Complete every request ``n_samples_per_prompt`` times, rows in request order."""
        ...

    def sync_weights(self, step: int) -> None:
        """Make the next rollouts use the training weights of optimizer step ``step``."""
        ...

    def shutdown(self) -> None:
        """Release what the engine holds; ``generate`` refuses afterwards."""
        ...


def sample_seed(base: int, sample: int) -> int:
    """The generator seed of sample ``sample`` of a prompt seeded ``base`` (splitmix64 of
    both: distinct, well spread, the same on every rank and in every process)."""
    z = (base * 0x9E3779B97F4A7C15 + (sample + 1) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


def assemble_batch(
    prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]], *, pad_token_id: int
) -> RolloutBatch:
    """Rows ``prompts[i] + responses[i]`` in the module's layout (left-padded prompts)."""
    width = max(len(p) for p in prompts)
    longest = max((len(r) for r in responses), default=0)
    rows = len(prompts)
    ids = torch.full((rows, width + longest), pad_token_id, dtype=torch.long)
    mask = torch.zeros((rows, width + longest), dtype=torch.long)
    for row, (prompt, response) in enumerate(zip(prompts, responses, strict=True)):
        ids[row, width - len(prompt) : width] = torch.tensor(prompt, dtype=torch.long)
        mask[row, width - len(prompt) : width] = 1
        if response:
            ids[row, width : width + len(response)] = torch.tensor(response, dtype=torch.long)
    mask[:, width:] = (ids[:, width:] != pad_token_id).long()
    return RolloutBatch(ids, mask, width)
