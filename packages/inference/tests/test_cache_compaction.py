"""Compaction, row reset and left trimming rewrite the static cache as asserted, in place.

Each row is filled with values that name it (row ``b`` holds ``b + 1`` in layer 0 and
``-(b + 1)`` in the values), so after `compact` every slot can be checked against where it
came from; the tensors keep their storage (a captured graph keeps pointing at them).
"""

from __future__ import annotations

import pytest
import torch

from deepshard.inference._cache import StaticKVCache


def _filled(batch: int = 4, max_len: int = 6) -> StaticKVCache:
    cache = StaticKVCache(
        num_layers=2, batch_size=batch, kv_heads=2, max_len=max_len, head_dim=3,
        dtype=torch.float32,
    )  # fmt: skip
    for layer, (keys, values) in enumerate(zip(cache.keys, cache.values, strict=True)):
        for row in range(batch):
            keys[row] = (row + 1) * 10 + layer
            values[row] = -((row + 1) * 10 + layer)
    cache.lengths.copy_(torch.tensor([5, 2, 4, 3])[:batch])
    return cache


def test_compact_moves_survivors_to_the_front_and_zeroes_the_rest() -> None:
    cache = _filled()
    pointers = [k.data_ptr() for k in cache.keys] + [cache.lengths.data_ptr()]
    cache.compact([3, 1])
    for layer, (keys, values) in enumerate(zip(cache.keys, cache.values, strict=True)):
        assert torch.all(keys[0] == 40 + layer) and torch.all(keys[1] == 20 + layer)
        assert torch.all(values[0] == -(40 + layer)) and torch.all(values[1] == -(20 + layer))
        assert torch.count_nonzero(keys[2:]) == 0 and torch.count_nonzero(values[2:]) == 0
    assert cache.lengths.tolist() == [3, 2, 0, 0]
    assert [k.data_ptr() for k in cache.keys] + [cache.lengths.data_ptr()] == pointers


def test_compact_with_every_row_reorders_and_repeats_are_refused() -> None:
    cache = _filled()
    cache.compact([2, 0, 3, 1])
    assert [int(cache.keys[0][row, 0, 0, 0]) for row in range(4)] == [30, 10, 40, 20]
    assert cache.lengths.tolist() == [4, 5, 3, 2]
    with pytest.raises(ValueError, match="repeated rows"):
        cache.compact([1, 1])


def test_reset_rows_empties_only_those_rows() -> None:
    cache = _filled()
    cache.reset_rows([0, 2])
    assert torch.count_nonzero(cache.keys[1][[0, 2]]) == 0
    assert torch.all(cache.keys[1][1] == 21) and torch.all(cache.values[0][3] == -40)
    assert cache.lengths.tolist() == [0, 2, 0, 3]


def test_trim_left_shifts_every_row() -> None:
    cache = _filled(batch=2, max_len=5)
    for row in range(2):  # slot s of row b holds 100 * b + s
        cache.keys[0][row] = (100 * row + torch.arange(5.0)).view(1, 5, 1)
    cache.trim_left(2)
    assert cache.keys[0][:, 0, :, 0].tolist() == [[2, 3, 4, 0, 0], [102, 103, 104, 0, 0]]
    assert torch.all(cache.values[1][:, :, :3] == cache.values[1][:, :, :1])
    assert torch.count_nonzero(cache.values[1][:, :, 3:]) == 0
    assert cache.lengths.tolist() == [3, 0]
    cache.trim_left(9)
    assert cache.lengths.tolist() == [0, 0] and torch.count_nonzero(cache.keys[0]) == 0
    with pytest.raises(ValueError, match="n >= 0"):
        cache.trim_left(-1)


def test_select_writes_each_row_at_its_own_position() -> None:
    cache = StaticKVCache(
        num_layers=1, batch_size=3, kv_heads=1, max_len=4, head_dim=1, dtype=torch.float32
    )
    cache.lengths.copy_(torch.tensor([2, 0, 1]))
    cache.select([2, 0], kv_len=3)
    new = torch.tensor([7.0, 8.0]).view(2, 1, 1, 1)
    keys, _ = cache.update(new, -new, 0)
    assert keys.shape == (2, 1, 3, 1)
    assert cache.keys[0][:, 0, :, 0].tolist() == [[0, 0, 8, 0], [0, 0, 0, 0], [0, 7, 0, 0]]
    mask = cache.attention_mask(1, torch.float32)[:, 0, 0]
    assert (mask == 0).tolist() == [[True, True, False], [True, True, True]]
    assert cache.positions(1).tolist() == [[1], [2]]
    cache.advance(1)
    assert cache.lengths.tolist() == [3, 0, 2]
