"""The data loader ``initialize`` builds from ``training_data``: one shard of the data per rank.

Ranks that read different samples (dp × ep, `Topology.batch_world_size`) each get a disjoint
share of the dataset through ``torch.utils.data.DistributedSampler`` (shuffled with seed 0, the
same permutation on every rank, as DeepSpeed's loader does), in micro-batches of
``train_micro_batch_size_per_gpu``. Tensor- and sequence-parallel peers read the same samples.
Call ``loader.sampler.set_epoch(epoch)`` for a new permutation each epoch.

The sampler (`ResumableSampler`) counts the samples this rank's loader has drawn in the current
epoch, so an engine checkpoint stores the loader's position and a resumed run continues with
the next micro-batch instead of the epoch's first (the loader has no workers, so what the
sampler handed out is exactly what the training loop received).

`RepeatingLoader` (DeepSpeed's name) turns any re-iterable loader into an endless one, for loops
that count steps rather than epochs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, Generic, TypeVar

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, IterableDataset

from deepshard.interface.errors import ConfigError

__all__ = ["RepeatingLoader", "ResumableSampler", "build_dataloader"]

_T = TypeVar("_T")


class ResumableSampler(DistributedSampler[Any]):
    """`DistributedSampler` that knows, and can be set to, its position in the epoch.

    Arguments are `DistributedSampler`'s.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.consumed = 0
        """Samples handed out since the current epoch's iteration began."""
        self._resume_at = 0

    def __iter__(self) -> Iterator[Any]:
        indices = list(super().__iter__())
        start, self._resume_at = self._resume_at, 0
        self.consumed = start
        for index in indices[start:]:
            self.consumed += 1
            yield index

    def state_dict(self) -> dict[str, int]:
        """``{"epoch", "consumed"}``: where the next iteration should continue."""
        return {"epoch": int(self.epoch), "consumed": int(self.consumed)}

    def load_state_dict(
        self, state: Mapping[str, Any], *, world_sizes: tuple[int, int] = (1, 1)
    ) -> None:
        """Continue the next iteration after the samples `state` says were consumed.

        Args:
            state: What `state_dict` returned.
            world_sizes: ``(saved, current)`` numbers of ranks reading different samples:
                every rank takes every ``world``-th sample of one permutation, so ``consumed``
                per rank scales by ``saved / current`` to cover the same share of the epoch.

        Raises:
            ConfigError: ``state`` is a dynamic-batching loader's position.
        """
        if "consumed" not in state:
            raise ConfigError(
                "the checkpoint's data position is a dynamic-batching loader's (groups, not "
                "samples); load it with dynamic batching on, as it was saved"
            )
        saved, current = world_sizes
        self.set_epoch(int(state["epoch"]))
        self._resume_at = min(int(state["consumed"]) * saved // current, self.num_samples)
        self.consumed = self._resume_at


class RepeatingLoader(Generic[_T]):
    """An endless iterator over ``loader``: when it is exhausted, it is iterated again.

    As DeepSpeed's ``RepeatingLoader``, so ``next(it)`` never ends a step-counted loop. A
    `DistributedSampler` keeps its epoch across restarts; call ``loader.sampler.set_epoch`` for
    a new permutation.

    Args:
        loader: A re-iterable (a ``DataLoader``, a list...); each restart calls ``iter`` on it
            again.
    """

    def __init__(self, loader: Iterable[_T]) -> None:
        self.loader = loader
        self._iterator = iter(loader)

    def __iter__(self) -> Iterator[_T]:
        return self

    def __next__(self) -> _T:
        try:
            return next(self._iterator)
        except StopIteration:
            self._iterator = iter(self.loader)
        try:
            return next(self._iterator)
        except StopIteration:
            # An exhausted iterator (a generator, iter(loader)) or an empty loader yields
            # nothing after a restart: repeating it would end the loop or spin forever.
            raise ConfigError(
                f"RepeatingLoader: {type(self.loader).__name__} yielded nothing when iterated "
                "again; wrap a re-iterable (a DataLoader, a list), not an iterator or generator, "
                "and make sure it is not empty"
            ) from None


def build_dataloader(
    dataset: Dataset[Any],
    *,
    micro_batch_size: int,
    batch_rank: int,
    batch_world_size: int,
    collate_fn: Callable[[list[Any]], Any] | None = None,
    drop_last: bool = False,
) -> DataLoader[Any]:
    """A loader over this rank's share of ``dataset``.

    Args:
        dataset: A map-style dataset (``__getitem__`` and ``__len__``).
        micro_batch_size: Samples per batch.
        batch_rank: This rank's index among the ranks reading different samples.
        batch_world_size: How many such ranks there are.
        collate_fn: Turns a list of samples into a batch; torch's default when None.
        drop_last: ``dataloader_drop_last``: drop the last incomplete micro-batch (and the
            samples that do not divide evenly over the ranks).

    Returns:
        The loader.

    Raises:
        ConfigError: ``dataset`` is iterable-style, which a sampler cannot shard.
    """
    if isinstance(dataset, IterableDataset):
        raise ConfigError(
            f"training_data is an IterableDataset ({type(dataset).__name__}), which cannot be "
            "split over ranks by a sampler; shard it per rank yourself and build the DataLoader"
        )
    sampler = ResumableSampler(
        dataset,
        num_replicas=batch_world_size,
        rank=batch_rank,
        shuffle=True,
        seed=0,
        drop_last=drop_last,
    )
    return DataLoader(
        dataset,
        batch_size=micro_batch_size,
        sampler=sampler,
        collate_fn=collate_fn,
        drop_last=drop_last,
        # iter() draws a worker base seed: from a generator of its own, not torch's global
        # one, so starting an epoch (or resuming one) never shifts dropout's random stream
        generator=torch.Generator().manual_seed(0),
    )
