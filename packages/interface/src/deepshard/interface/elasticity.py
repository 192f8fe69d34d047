"""Elastic batch sizes: one global batch that trains the same on many different GPU counts.

A job that may be rescheduled on another number of GPUs keeps converging as before only if
its global batch stays the same; gradient accumulation makes that possible as long as the
global batch divides into ``micro_batch × accumulation × data-parallel ranks`` for every GPU
count the scheduler may give it. The `elasticity` section names the acceptable micro-batches,
the largest acceptable global batch and the GPU range; `compute_elastic_config` chooses, as
DeepSpeed 0.19.7 does (same results, `deepshard.interface` is torch- and numpy-free):

1. **Candidates.** For each micro-batch and for their least common multiple (each a *base*
   not above ``max_train_batch_size``), the base times the largest highly composite number
   that keeps it within the maximum (highly composite numbers have the most divisors, hence
   the most GPU counts).
2. **Valid GPU counts of a candidate.** For each micro-batch dividing it, ``n = batch / micro``
   and every divisor of ``n`` up to ``n / 2``, within ``[min_gpus, max_gpus]``.
3. **Choice.** The candidate with the most valid counts; ties go to the larger batch
   (``prefer_larger_batch``) or the smaller.

Version 0.2 works in whole nodes: the search runs over node counts (``min_gpus`` and
``max_gpus`` divided by ``num_gpus_per_node``, the maximum batch by the data-parallel ranks per
node, ``num_gpus_per_node / model_parallel_size``) and scales back; when the current world
is not one of the valid sizes it falls back to the largest (or smallest) multiple of a
micro-batch times the current data-parallel size that fits the maximum. Given the world size,
the micro-batch is the largest acceptable one dividing ``batch / world``.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from deepshard.interface.config import DeepShardConfig, ElasticityConfig
from deepshard.interface.errors import ConfigError

__all__ = [
    "HIGHLY_COMPOSITE",
    "MINIMUM_DEEPSPEED_VERSION",
    "ElasticBatch",
    "compute_elastic_config",
    "elastic_batch",
]

HIGHLY_COMPOSITE = (
    1, 2, 4, 6, 12, 24, 36, 48, 60, 120, 180, 240, 360, 720, 840, 1260, 1680, 2520, 5040, 7560,
    10080, 15120, 20160, 25200, 27720, 45360, 50400, 55440, 83160, 110880, 166320, 221760,
    277200, 332640, 498960, 554400, 665280, 720720,
)  # fmt: skip
"""The 38 smallest highly composite numbers (global batches up to ~720K)."""

MINIMUM_DEEPSPEED_VERSION = "0.3.8"
"""The first DeepSpeed release with elasticity: older ``target_deepspeed_version`` is refused."""

_LATEST_VERSION = 0.2


@dataclass(frozen=True)
class ElasticBatch:
    """The batch sizes elasticity chose for one world size."""

    train_batch_size: int
    """The global batch (the same for every valid GPU count)."""

    valid_gpus: tuple[int, ...]
    """The data-parallel sizes this batch works for."""

    micro_batch_size: int
    """Per-rank micro-batch at this world size."""

    gradient_accumulation_steps: int
    """``train_batch_size / (micro_batch_size × world_size)``."""


def _error(key: str, message: str) -> ConfigError:
    return ConfigError.from_problems([(f"elasticity.{key}" if key else "elasticity", message)])


def _candidates(bases: Sequence[int], largest: int) -> list[int]:
    found = set()
    for base in bases:
        if base > largest:  # scaling only grows it: nothing within the maximum
            continue
        if base == largest:
            found.add(base)
        else:
            found.add(base * max(h for h in HIGHLY_COMPOSITE if h <= largest // base))
    return sorted(found)


def _valid_counts(batch: int, micro_batches: Sequence[int], low: int, high: int) -> list[int]:
    counts = set()
    for micro in micro_batches:
        if batch % micro:
            continue
        ranks = batch // micro
        if low <= ranks <= high:
            counts.add(ranks)
        counts.update(i for i in range(max(low, 1), min(high, ranks // 2) + 1) if ranks % i == 0)
    return sorted(counts)


def _search(
    micro_batches: Sequence[int], largest: int, low: int, high: int, prefer_larger: bool
) -> tuple[int, list[int]]:
    """Steps 1-3 of the module docstring (DeepSpeed's version 0.1)."""
    low = low or 1
    high = high or largest // min(micro_batches)
    if any(micro > largest for micro in micro_batches):
        raise _error("micro_batch_sizes", f"every micro-batch must be <= {largest} (the maximum)")
    bases = [*micro_batches, math.lcm(*micro_batches)]
    best: tuple[int, int] = (0, min(micro_batches) if prefer_larger else -min(micro_batches))
    chosen: list[int] | None = None
    for batch in _candidates(bases, largest):
        counts = _valid_counts(batch, micro_batches, low, high)
        key = (len(counts), batch if prefer_larger else -batch)
        if key > best:
            best, chosen = key, counts
    if chosen is None:
        raise _error(
            "",
            f"no global batch up to {largest} works for any GPU count in [{low}, {high}]; "
            "raise max_train_batch_size or widen min_gpus/max_gpus",
        )
    return abs(best[1]), chosen


def _node_micro(
    micro_batches: Sequence[int], batch: Fraction, gpus: int, larger: bool
) -> int | None:
    chosen = None
    for micro in micro_batches:
        if (batch // gpus) % micro == 0 and (chosen is None or (larger and chosen < micro)):
            chosen = micro
    return chosen


def _search_nodes(elastic: ElasticityConfig, gpus: int) -> tuple[int, list[int], int | None]:
    """Version 0.2: the search over whole nodes, with the fallback for an invalid world."""
    per_node, mp = elastic.num_gpus_per_node, elastic.model_parallel_size
    if per_node % mp:
        raise _error(
            "num_gpus_per_node", f"{per_node} must be divisible by model_parallel_size {mp}"
        )
    micro, larger = elastic.micro_batch_sizes, elastic.prefer_larger_batch
    dp_per_node = per_node // mp
    batch, nodes = _search(
        micro,
        elastic.max_train_batch_size // dp_per_node,
        elastic.min_gpus // per_node,
        elastic.max_gpus // per_node,
        larger,
    )
    batch *= dp_per_node
    valid = [n * dp_per_node for n in nodes]
    if gpus // mp in valid:
        return batch, valid, _node_micro(micro, Fraction(batch), gpus, larger)
    dp_size = Fraction(gpus, per_node) * dp_per_node
    fits = [(elastic.max_train_batch_size // (m * dp_size)) * m * dp_size for m in micro]
    fallback = max(fits) if larger else min(fits)
    return int(fallback), [int(dp_size)], _node_micro(micro, fallback, gpus, larger)


def _version_tuple(text: str) -> tuple[int, ...]:
    match = re.match(r"^\s*v?(\d+(?:\.\d+)*)", text)
    if match is None:
        raise ConfigError(
            f"target_deepspeed_version {text!r} is not a version number; pass e.g. '0.19.7'"
        )
    return tuple(int(part) for part in match.group(1).split("."))


def _section(config: Mapping[str, Any] | DeepShardConfig | ElasticityConfig) -> ElasticityConfig:
    if isinstance(config, ElasticityConfig):
        return config
    if isinstance(config, DeepShardConfig):
        return config.elasticity
    if not isinstance(config, Mapping):
        raise ConfigError(
            f"compute_elastic_config: expected a config dict, got {type(config).__name__}"
        )
    if "elasticity" not in config:
        raise _error("", "missing from the config; add it to run an elastic training job")
    return ElasticityConfig.model_validate(config["elasticity"])


def _world(world_size: int, environ: Mapping[str, str]) -> int:
    if world_size > 0:
        return world_size
    value = environ.get("WORLD_SIZE", "")
    if not value.isdigit():
        raise ConfigError(
            "compute_elastic_config needs the world size: pass world_size= or set WORLD_SIZE "
            f"(WORLD_SIZE is {value or 'unset'!r})"
        )
    return int(value)


def _micro_for(elastic: ElasticityConfig, batch: int, world: int, valid: Sequence[int]) -> int:
    if world not in valid:
        raise _error(
            "",
            f"world size {world} is not one of the valid GPU counts {list(valid)}; run on one "
            "of them or change min_gpus/max_gpus/micro_batch_sizes",
        )
    for micro in sorted(set(elastic.micro_batch_sizes), reverse=True):
        if (batch // world) % micro == 0:
            return micro
    raise _error("micro_batch_sizes", f"none divides {batch} / {world}")


def compute_elastic_config(
    config: Mapping[str, Any] | DeepShardConfig | ElasticityConfig,
    target_deepspeed_version: str,
    world_size: int = 0,
    return_microbatch: bool = False,
    *,
    environ: Mapping[str, str] | None = None,
) -> tuple[int, list[int]] | tuple[int, list[int], int]:
    """DeepSpeed's ``deepspeed.elasticity.compute_elastic_config``, with the same results.

    Args:
        config: A DeepSpeed config dict (its ``elasticity`` block is read), a
            `DeepShardConfig` or its `ElasticityConfig`.
        target_deepspeed_version: The DeepSpeed version the job targets; below
            `MINIMUM_DEEPSPEED_VERSION` is refused.
        world_size: The data-parallel world size (0: from ``WORLD_SIZE`` where needed).
        return_microbatch: Also return the micro-batch when ``world_size`` is 0.
        environ: Where ``WORLD_SIZE`` is read (``os.environ`` by default).

    Returns:
        ``(train_batch_size, valid_gpus)``, plus the micro-batch when ``world_size`` > 0 or
        ``return_microbatch``.

    Raises:
        ConfigError: Elasticity is missing or disabled, the version or model-parallel setup is
            not supported, no batch fits, or the world size is not a valid GPU count.
    """
    elastic = _section(config)
    env = os.environ if environ is None else environ
    if not elastic.enabled:
        raise _error("enabled", "elasticity is disabled; set it to true for an elastic job")
    if elastic.model_parallel_size > 1 and elastic.version != _LATEST_VERSION:
        raise _error("model_parallel_size", "needs elasticity version 0.2")
    if _version_tuple(target_deepspeed_version) < _version_tuple(MINIMUM_DEEPSPEED_VERSION):
        raise ConfigError(
            f"target_deepspeed_version {target_deepspeed_version} predates elasticity "
            f"(DeepSpeed {MINIMUM_DEEPSPEED_VERSION}); target a newer release"
        )
    node_micro = None
    if elastic.version == 0.1:
        batch, valid = _search(
            elastic.micro_batch_sizes,
            elastic.max_train_batch_size,
            elastic.min_gpus,
            elastic.max_gpus,
            elastic.prefer_larger_batch,
        )
    else:
        batch, valid, node_micro = _search_nodes(elastic, _world(world_size, env))
    if world_size > 0:
        return batch, valid, _micro_for(elastic, batch, world_size, valid)
    if not return_microbatch:
        return batch, valid
    if elastic.version == 0.1:
        return batch, valid, _micro_for(elastic, batch, _world(0, env), valid)
    if node_micro is None:
        raise _error("micro_batch_sizes", f"none divides the batch {batch} over the world")
    return batch, valid, node_micro


def elastic_batch(config: DeepShardConfig, dp_world_size: int) -> ElasticBatch:
    """The batch sizes the engine trains with under an enabled ``elasticity`` section.

    Raises:
        ConfigError: As `compute_elastic_config` (the world size is not a valid count ...).
    """
    result = compute_elastic_config(config, MINIMUM_DEEPSPEED_VERSION, world_size=dp_world_size)
    batch, valid, micro = result  # type: ignore[misc]  # world_size > 0: three values
    return ElasticBatch(batch, tuple(valid), micro, batch // (micro * dp_world_size))
