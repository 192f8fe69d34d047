"""``RepeatingLoader`` restarts a re-iterable when it runs out and refuses one it cannot restart."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import deepshard.engine as ds


def test_a_list_is_repeated_in_order() -> None:
    loader = ds.RepeatingLoader([1, 2, 3])
    assert iter(loader) is loader
    assert list(itertools.islice(loader, 8)) == [1, 2, 3, 1, 2, 3, 1, 2]


def test_a_dataloader_restarts_with_a_new_iterator_each_epoch() -> None:
    data = TensorDataset(torch.arange(5))
    loader = ds.RepeatingLoader(DataLoader(data, batch_size=2))
    batches = [batch[0].tolist() for batch in itertools.islice(loader, 6)]
    epoch = [[0, 1], [2, 3], [4]]
    assert batches == epoch + epoch


def test_an_exhausted_iterator_or_an_empty_loader_is_refused() -> None:
    loader = ds.RepeatingLoader(x for x in range(2))
    assert [next(loader), next(loader)] == [0, 1]
    with pytest.raises(ds.ConfigError, match="not an iterator or generator"):
        next(loader)
    with pytest.raises(ds.ConfigError, match="list yielded nothing"):
        next(ds.RepeatingLoader([]))
