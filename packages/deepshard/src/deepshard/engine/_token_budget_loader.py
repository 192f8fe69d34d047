"""The data loader of dynamic batching: this rank's micro-batches of a `StepPlan`, resumable.

`TokenBudgetSampler` is a batch sampler: each item is the list of sample indices of one of this
rank's micro-batches (its ``mb`` packed groups, concatenated), step after step, so the
``DataLoader`` calls the collate function on a variable number of samples. `TokenBudgetLoader`
counts the batches it *delivered* (workers draw indices ahead of the training loop, so the
sampler's own count would run ahead), which gives the engine the step the loop is on (whose
sample count scales the learning rate) and a checkpoint the position to resume from. The
position is stored as groups consumed over all ranks (a world-size-free count): a run resumed
on another number of ranks continues from the same group, since the packing does not depend
on the world.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset

from deepshard.engine.dynamic_batching import StepPlan, plan_steps, read_seqlen_metric
from deepshard.interface import BatchSizes
from deepshard.interface.config import DataEfficiencyConfig, DynamicBatchingConfig
from deepshard.interface.errors import ConfigError

__all__ = [
    "TokenBudgetLoader",
    "TokenBudgetSampler",
    "build_token_budget_loader",
    "dynamic_batching_loader",
    "sample_length",
]


class TokenBudgetSampler:
    """Yields this rank's micro-batches (lists of sample indices) of one epoch's `StepPlan`.

    Args:
        seqlens: Each sample's length in tokens.
        section: The ``dynamic_batching`` config section.
        micro_batch_size: Groups per micro-batch.
        accumulation_steps: Micro-batches per step.
        rank: This rank among the ranks reading different samples.
        ranks: How many such ranks there are.
        seed: ``data_efficiency.seed`` (the ``random`` order draws seed + epoch).
        filter_ids: The samples to use (all when None).
    """

    def __init__(
        self,
        seqlens: Sequence[int],
        section: DynamicBatchingConfig,
        *,
        micro_batch_size: int,
        accumulation_steps: int,
        rank: int,
        ranks: int,
        seed: int,
        filter_ids: Sequence[int] | None = None,
    ) -> None:
        self.seqlens = list(seqlens)
        self.section = section
        self.rank = rank
        self._shape = (micro_batch_size, accumulation_steps, ranks)
        self._seed = seed
        self._filter = None if filter_ids is None else list(filter_ids)
        self.epoch = 0
        self._start = 0  # groups consumed before this epoch's first step (a resume)
        self.served = 0
        """Micro-batches the loader delivered since this epoch's iteration began."""
        self.plan = self._plan()

    def _plan(self) -> StepPlan:
        mb, gas, ranks = self._shape
        return plan_steps(
            self.seqlens, self.section, micro_batch_size=mb, accumulation_steps=gas,
            ranks=ranks, seed=self._seed, epoch=self.epoch, offset=self._start,
            filter_ids=self._filter,
        )  # fmt: skip

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` at its first step (a new order when it is ``random``)."""
        self.epoch, self._start, self.served = int(epoch), 0, 0
        self.plan = self._plan()

    def __len__(self) -> int:
        return self.plan.num_steps * self.plan.accumulation_steps

    def __iter__(self) -> Iterator[list[int]]:
        plan = self.plan
        for step in range(plan.num_steps):
            for micro in range(plan.accumulation_steps):
                yield plan.micro_batch(step, micro, self.rank)
        if self._start:  # a resumed epoch is done: iterating it again starts at its beginning
            self._start = 0
            self.plan = self._plan()

    def samples_in_served_step(self) -> int | None:
        """Samples (over all ranks) of the step whose micro-batch was delivered last; None
        before the first."""
        if self.served == 0:
            return None
        return self.plan.samples_in_step((self.served - 1) // self.plan.accumulation_steps)

    def state_dict(self) -> dict[str, int]:
        """``{"epoch", "groups"}``: the epoch and the groups its completed steps consumed."""
        steps = self.served // self.plan.accumulation_steps
        return {"epoch": self.epoch, "groups": self.plan.offset + steps * self.plan.groups_per_step}

    def load_state_dict(
        self, state: Mapping[str, Any], *, world_sizes: tuple[int, int] = (1, 1)
    ) -> None:
        """Continue the next iteration after the groups ``state`` says were consumed.

        ``world_sizes`` is accepted for the engine's other loader and not needed: the position
        counts groups over all ranks.

        Raises:
            ConfigError: ``state`` is another loader's (no ``groups``).
        """
        del world_sizes
        if "groups" not in state:
            raise ConfigError(
                "the checkpoint's data position is a fixed-size loader's, this engine uses "
                "dynamic batching; load it with the config it was saved with"
            )
        self.epoch, self._start, self.served = int(state["epoch"]), int(state["groups"]), 0
        self.plan = self._plan()
        if self.plan.num_steps == 0:  # saved at the end of its epoch: go on with the next
            self.set_epoch(self.epoch + 1)


class TokenBudgetLoader(DataLoader[Any]):
    """A ``DataLoader`` over a `TokenBudgetSampler` that reports each delivered batch to it."""

    batch_sampler: TokenBudgetSampler

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` at its first step (``loader.sampler`` is torch's sequential one)."""
        self.batch_sampler.set_epoch(epoch)

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        sampler = self.batch_sampler
        sampler.served = 0
        for batch in super().__iter__():
            sampler.served += 1
            yield batch


def build_token_budget_loader(
    dataset: Dataset[Any],
    sampler: TokenBudgetSampler,
    *,
    collate_fn: Callable[[list[Any]], Any] | None = None,
    num_workers: int = 0,
    pin_memory: bool = False,
) -> TokenBudgetLoader:
    """A loader over ``dataset`` whose batches are ``sampler``'s micro-batches.

    Raises:
        ConfigError: ``dataset`` is iterable-style, or its length differs from the lengths'.
    """
    if isinstance(dataset, IterableDataset):
        raise ConfigError(
            f"dynamic batching needs a map-style dataset (indices), not {type(dataset).__name__}"
        )
    size = len(dataset)  # type: ignore[arg-type]
    if size != len(sampler.seqlens):
        raise ConfigError(
            f"dynamic batching: the dataset has {size} samples but {len(sampler.seqlens)} "
            "lengths were given (a stale metrics_path? regenerate it for this dataset)"
        )
    return TokenBudgetLoader(
        dataset,
        batch_sampler=sampler,
        collate_fn=collate_fn,
        num_workers=num_workers,
        pin_memory=pin_memory,
        generator=torch.Generator().manual_seed(0),  # as the engine's other loader
    )


def sample_length(sample: Any, index: int) -> int:
    """A sample's length in tokens, when no ``seqlen`` metric is given: a 1-D tensor's or a
    sequence's length, or that of a dict's ``input_ids``.

    Raises:
        ConfigError: The sample has none of these shapes.
    """
    value = sample.get("input_ids") if isinstance(sample, Mapping) else sample
    if isinstance(value, torch.Tensor) and value.dim() == 1:
        return int(value.numel())
    if isinstance(value, (list, tuple)) and not isinstance(sample, tuple):
        return len(value)
    raise ConfigError(
        f"dynamic batching cannot tell the length of sample {index} ({type(sample).__name__}; "
        "it knows 1-D tensors, lists and dicts with input_ids): set "
        "data_efficiency.data_sampling.dynamic_batching.metrics_path, or build the loader "
        "with engine.dynamic_batching_loader(dataset, seqlens=...)"
    )


def dynamic_batching_loader(
    dataset: Dataset[Any],
    efficiency: DataEfficiencyConfig,
    batch: BatchSizes,
    *,
    rank: int,
    ranks: int,
    seqlens: Sequence[int] | None = None,
    collate_fn: Callable[[list[Any]], Any] | None = None,
    filter_ids: Sequence[int] | None = None,
) -> TokenBudgetLoader:
    """This rank's dynamic-batching loader over ``dataset`` (the engine's builder).

    The lengths are ``seqlens``, else the ``metrics_path`` metric, else each sample's
    `sample_length`.

    Raises:
        ConfigError: Dynamic batching is off, or the lengths cannot be had.
    """
    sampling = efficiency.data_sampling
    section = sampling.dynamic_batching
    if not section.enabled:
        raise ConfigError.from_problems(
            [(section.config_key + ".enabled", "dynamic batching is off; set it to true")]
        )
    if seqlens is None and section.metrics_path is not None:
        seqlens = read_seqlen_metric(section.metrics_path)
    if seqlens is None:
        size = len(dataset)  # type: ignore[arg-type]
        seqlens = [sample_length(dataset[i], i) for i in range(size)]
    sampler = TokenBudgetSampler(
        seqlens, section, micro_batch_size=batch.train_micro_batch_size_per_gpu,
        accumulation_steps=batch.gradient_accumulation_steps, rank=rank, ranks=ranks,
        seed=efficiency.seed, filter_ids=filter_ids,
    )  # fmt: skip
    return build_token_budget_loader(
        dataset,
        sampler,
        collate_fn=collate_fn,
        num_workers=sampling.num_workers,
        pin_memory=sampling.pin_memory,
    )
