"""Dynamic batching: micro-batches packed to a token budget, the learning rate scaled to match.

Config ``data_efficiency.data_sampling.dynamic_batching`` (DeepSpeed's keys). Samples of
different lengths waste compute when batched by count: a batch of short sequences is mostly
padding, a batch of long ones may not fit. Dynamic batching packs samples into *groups* whose
summed lengths stay within ``max_tokens``, and an optimizer step consumes a fixed number of
groups, so the number of *samples* per step varies; the learning rate follows it.

The plan, computed identically on every rank from the samples' lengths:

1. **Order.** The samples (all, or ``filter_ids``) in ``sequence_picking_order``: the
   dataset's order (``dataloader``), ascending length (``seqlen``, ties by index) or a
   permutation drawn from ``data_efficiency.seed`` plus the epoch (``random``).
2. **Drop** samples longer than ``max_tokens`` on their own (a warning counts them).
3. **Pack** greedily in that order: a group takes the next sample while it holds fewer than
   ``max_batch_size`` samples and the sample fits in the remaining budget. A group that has
   reached ``min_batch_size`` closes at the first sample that does not fit; one that has not
   skips that sample (it starts a later group) and takes the first following ones that fit.
   A group that cannot reach ``min_batch_size`` with what is left is dropped (counted in the
   warning). DeepSpeed 0.19.7's packer instead always drops the dataset's last sample and
   silently stops packing at the first group it cannot complete, losing the rest of the data.
4. **Steps.** A step takes ``train_batch_size`` consecutive groups (micro batch × gradient
   accumulation × data-parallel ranks, the config's count, now in groups); a trailing partial
   step is dropped. Group ``k`` of a step goes to rank ``k % dp``, slot ``(k // dp) % mb`` of
   micro-step ``k // (dp * mb)`` (the interleaving of a ``DistributedSampler``, which spreads a
   length-sorted order evenly over the ranks); one micro-batch is the concatenation of its
   ``mb`` groups' samples.
5. **Learning rate.** Step ``i`` holds ``n_i`` samples; the schedule's rate applies to a batch
   of ``train_batch_size`` samples, so the step runs at ``lr * n_i / train_batch_size``
   (``linear``), ``lr * sqrt(n_i / train_batch_size)`` (``sqrt``) or ``lr`` (``none``). The
   engine scales the param groups for the optimizer step of the batch the loader served and
   puts the schedule's values back before the schedule steps, so a schedule that multiplies
   the current rate never compounds the scale, and a checkpoint holds unscaled rates.

Lengths come from ``seqlens=`` or from ``metrics_path``: the ``seqlen`` metric DeepSpeed's data
analyzer writes (`read_seqlen_metric`).
"""

from __future__ import annotations

import collections
import logging
import math
import os
import random
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from deepshard.interface.config import DynamicBatchingConfig
from deepshard.interface.errors import ConfigError

__all__ = ["StepPlan", "pack_by_tokens", "plan_steps", "read_seqlen_metric", "scale_lr"]

_LOG = logging.getLogger("deepshard.engine")


def _ordered(seqlens: Sequence[int], ids: Sequence[int], order: str, seed: int) -> list[int]:
    if order == "seqlen":
        return sorted(ids, key=lambda i: (seqlens[i], i))
    picked = list(ids)
    if order == "random":
        random.Random(seed).shuffle(picked)
    return picked


def pack_by_tokens(
    seqlens: Sequence[int],
    max_tokens: int,
    *,
    min_batch_size: int = 1,
    max_batch_size: int | None = None,
    order: str = "dataloader",
    seed: int = 0,
    filter_ids: Sequence[int] | None = None,
) -> list[tuple[int, ...]]:
    """The groups of sample indices, each within ``max_tokens`` (steps 1-3 of the module doc).

    Args:
        seqlens: Each sample's length in tokens, by index.
        max_tokens: The budget of summed lengths per group.
        min_batch_size: Fewest samples per group.
        max_batch_size: Most samples per group (None: no cap).
        order: ``"dataloader"``, ``"seqlen"`` or ``"random"``.
        seed: The permutation's seed for ``"random"``.
        filter_ids: The samples to use (all when None).

    Raises:
        ConfigError: A bound is inconsistent, or an index is out of range.
    """
    if max_batch_size is not None and max_batch_size < min_batch_size:
        raise ConfigError.from_problems(
            [
                (
                    "data_efficiency.data_sampling.dynamic_batching.max_batch_size",
                    f"{max_batch_size} is below min_batch_size {min_batch_size}",
                )
            ]
        )
    ids = range(len(seqlens)) if filter_ids is None else filter_ids
    bad = [i for i in ids if not 0 <= i < len(seqlens)]
    if bad:
        raise ConfigError(
            f"dynamic batching: filter_ids {bad[:5]} are not sample indices of a dataset of "
            f"{len(seqlens)} samples"
        )
    too_long = [i for i in ids if seqlens[i] > max_tokens]
    fitting = [i for i in _ordered(seqlens, ids, order, seed) if seqlens[i] <= max_tokens]
    pending = collections.deque(fitting)
    cap = max_batch_size or len(seqlens) or 1
    groups: list[tuple[int, ...]] = []
    dropped = 0
    while pending:
        group: list[int] = []
        tokens = 0
        skipped: list[int] = []
        while pending and len(group) < cap:
            length = seqlens[pending[0]]
            if tokens + length <= max_tokens:
                group.append(pending.popleft())
                tokens += length
            elif len(group) >= min_batch_size:
                break
            else:  # short of min_batch_size: look further for samples that fit
                skipped.append(pending.popleft())
        pending.extendleft(reversed(skipped))
        if len(group) >= min_batch_size:
            groups.append(tuple(group))
        else:  # nothing left completes it
            dropped += len(group)
    if too_long or dropped:
        _LOG.warning(
            "dynamic batching: %d sample(s) longer than max_tokens %d left out (first: %s); "
            "%d sample(s) left out that could not complete a group of min_batch_size %d",
            len(too_long), max_tokens, too_long[:5], dropped, min_batch_size,
        )  # fmt: skip
    return groups


@dataclass(frozen=True)
class StepPlan:
    """The groups of one epoch cut into optimizer steps (step 4 of the module doc).

    Attributes:
        groups: Every group of sample indices, in order.
        micro_batch_size: Groups per micro-batch (``train_micro_batch_size_per_gpu``).
        accumulation_steps: Micro-batches per optimizer step and rank.
        ranks: Ranks reading different samples.
        offset: Groups before the first step (a resumed epoch continues from there).
    """

    groups: tuple[tuple[int, ...], ...]
    micro_batch_size: int
    accumulation_steps: int
    ranks: int
    offset: int = 0

    @property
    def groups_per_step(self) -> int:
        """``train_batch_size``: the groups one optimizer step consumes."""
        return self.micro_batch_size * self.accumulation_steps * self.ranks

    @property
    def num_steps(self) -> int:
        """Complete steps after ``offset`` (a trailing partial step is dropped)."""
        return max(0, len(self.groups) - self.offset) // self.groups_per_step

    def _group(self, step: int, micro: int, rank: int, slot: int) -> tuple[int, ...]:
        k = (micro * self.micro_batch_size + slot) * self.ranks + rank
        return self.groups[self.offset + step * self.groups_per_step + k]

    def micro_batch(self, step: int, micro: int, rank: int) -> list[int]:
        """The sample indices ``rank`` reads at micro-step ``micro`` of ``step``."""
        return [
            index
            for slot in range(self.micro_batch_size)
            for index in self._group(step, micro, rank, slot)
        ]

    def samples_in_step(self, step: int) -> int:
        """How many samples ``step`` holds over all ranks and micro-steps."""
        start = self.offset + step * self.groups_per_step
        return sum(len(g) for g in self.groups[start : start + self.groups_per_step])


def plan_steps(
    seqlens: Sequence[int],
    section: DynamicBatchingConfig,
    *,
    micro_batch_size: int,
    accumulation_steps: int,
    ranks: int,
    seed: int,
    epoch: int = 0,
    offset: int = 0,
    filter_ids: Sequence[int] | None = None,
) -> StepPlan:
    """The `StepPlan` of one epoch for the config section (the order's seed is seed + epoch).

    Raises:
        ConfigError: The section has no ``max_tokens``, or not one step can be formed.
    """
    if section.max_tokens is None:
        raise ConfigError.from_problems(
            [("data_efficiency.data_sampling.dynamic_batching.max_tokens", "required")]
        )
    groups = pack_by_tokens(
        seqlens,
        section.max_tokens,
        min_batch_size=section.min_batch_size,
        max_batch_size=section.max_batch_size,
        order=section.sequence_picking_order,
        seed=seed + epoch,
        filter_ids=filter_ids,
    )
    plan = StepPlan(tuple(groups), micro_batch_size, accumulation_steps, ranks, offset)
    if offset == 0 and plan.num_steps == 0:
        raise ConfigError(
            f"dynamic batching packed {len(seqlens)} samples into {len(groups)} group(s) of at "
            f"most {section.max_tokens} tokens, fewer than one step's train_batch_size of "
            f"{plan.groups_per_step} groups; use more data, a smaller max_tokens or a smaller "
            "train_batch_size"
        )
    return plan


def scale_lr(lr: float, samples: int, reference: int, method: str) -> float:
    """``lr`` for a step of ``samples`` samples, given that it suits ``reference`` samples.

    Raises:
        ConfigError: ``method`` is not ``linear``, ``sqrt`` or ``none``.
    """
    if method == "linear":
        return lr * samples / reference
    if method == "sqrt":
        return lr * math.sqrt(samples / reference)
    if method == "none":
        return lr
    raise ConfigError(
        f"dynamic_batching.lr_scaling_method must be linear, sqrt or none, got {method!r}"
    )


# DeepSpeed's data analyzer writes each metric as an indexed dataset: an index file (9-byte
# magic, version as u64, dtype code as u8, sequence count and document count as u64, then each
# sequence's element count as int32, each sequence's byte offset into the data file as int64,
# the document boundaries as int64) and a data file of the raw values. The seqlen metric holds
# one value per sample. The dtype codes are DeepSpeed's (they differ from Megatron's).
_INDEX_MAGIC = b"MMIDIDX\x00\x00"
_DTYPES = {1: "B", 2: "b", 3: "h", 4: "i", 5: "q", 6: "H", 7: "I", 8: "Q"}
_HEADER = struct.Struct("<9sQBQQ")


def read_seqlen_metric(metrics_path: str | os.PathLike[str]) -> list[int]:
    """Each sample's length from the ``seqlen`` metric of DeepSpeed's data analyzer.

    Reads ``<metrics_path>/seqlen/seqlen_sample_to_metric.{idx,bin}`` (no pickle, no numpy).

    Raises:
        ConfigError: The files are missing, damaged, or hold more than one value per sample.
    """
    stem = Path(metrics_path) / "seqlen" / "seqlen_sample_to_metric"
    index, data = stem.with_suffix(".idx"), stem.with_suffix(".bin")
    fix = (
        "run DeepSpeed's data analyzer with a 'seqlen' metric there, or pass seqlens= to "
        "engine.dynamic_batching_loader"
    )
    try:
        header = index.read_bytes()
        values = data.read_bytes()
    except OSError as exc:
        raise ConfigError(
            f"dynamic_batching.metrics_path: cannot read {index} / {data} ({exc}); {fix}"
        ) from exc
    try:
        magic, version, code, count, _ = _HEADER.unpack_from(header)
        if magic != _INDEX_MAGIC or version != 1 or code not in _DTYPES:
            raise ValueError(f"not a version-1 indexed-dataset index (dtype code {code})")
        start = _HEADER.size
        sizes = memoryview(header)[start : start + 4 * count].cast("i")
        offsets = memoryview(header)[start + 4 * count : start + 12 * count].cast("q")
        if len(sizes) != count or len(offsets) != count:
            raise ValueError(f"the index is shorter than its {count} entries")
        if any(size != 1 for size in sizes):
            raise ValueError("a sample has more than one seqlen value")
        kind = _DTYPES[code]
        return [int(struct.unpack_from(f"<{kind}", values, at)[0]) for at in offsets]
    except (ValueError, TypeError, struct.error) as exc:
        raise ConfigError(
            f"dynamic_batching.metrics_path: {index} is not a seqlen metric ({exc}); {fix}"
        ) from exc
