"""The data loader ``initialize`` builds from ``training_data``: one shard of the data per rank.

Ranks that read different samples (dp × ep, `Topology.batch_world_size`) each get a disjoint
share of the dataset through ``torch.utils.data.DistributedSampler`` (shuffled with seed 0, the
same permutation on every rank, as DeepSpeed's loader does), in micro-batches of
``train_micro_batch_size_per_gpu``. Tensor- and sequence-parallel peers read the same samples.
Call ``loader.sampler.set_epoch(epoch)`` for a new permutation each epoch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch.utils.data import DataLoader, Dataset, DistributedSampler, IterableDataset

from deepshard.interface.errors import ConfigError

__all__ = ["build_dataloader"]


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
    sampler: DistributedSampler[Any] = DistributedSampler(
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
    )
