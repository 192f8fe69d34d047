"""`StaticKVCache.update` writes the same slots whether the selected rows form a span or not.

A span of rows (``first..first+n-1`` in order) is written with one ``scatter_`` into a view and
returned as views; any other selection goes through advanced indexing and a gather. Both must
put batch entry ``i``'s keys at row ``rows[i]``, slots ``lengths[row] + 0..q-1``, and
`StaticKVCache.advance` with per-row counts moves each row by its own real-token count (a
right-padded prefill). The reference is a plain per-row slice assignment.
"""

from __future__ import annotations

import torch

from deepshard.inference._cache import StaticKVCache

SIZES = {"num_layers": 1, "batch_size": 4, "kv_heads": 2, "max_len": 8, "head_dim": 3}


def _write(rows: list[int], start: list[int], q: int) -> tuple[StaticKVCache, torch.Tensor]:
    cache = StaticKVCache(**SIZES, dtype=torch.float32)
    cache.lengths.copy_(torch.tensor(start))
    keys = torch.randn(len(rows), SIZES["kv_heads"], q, SIZES["head_dim"])
    cache.select(rows, kv_len=SIZES["max_len"])
    got_keys, got_values = cache.layers[0].update(keys, -keys, 0)
    assert torch.equal(got_keys, cache.keys[0][rows]) and torch.equal(got_values, -got_keys)
    return cache, keys


def test_span_and_scattered_rows_write_the_reference_slots() -> None:
    torch.manual_seed(0)
    start = [1, 3, 0, 2]
    for rows in ([1, 2, 3], [0, 1], [3, 1], [2, 0, 3]):
        cache, keys = _write(rows, start, q=2)
        assert (cache.span() is not None) == (rows in ([1, 2, 3], [0, 1]))
        expected = torch.zeros_like(cache.keys[0])
        for index, row in enumerate(rows):
            expected[row, :, start[row] : start[row] + 2] = keys[index]
        assert torch.equal(cache.keys[0], expected), rows
        assert torch.equal(cache.values[0], -expected), rows
        cache.advance([2, 1, 1][: len(rows)])
        moved = list(start)
        for row, count in zip(rows, [2, 1, 1], strict=False):
            moved[row] += count
        assert cache.lengths.tolist() == moved


def test_mask_hides_slots_past_each_rows_position() -> None:
    cache = StaticKVCache(**SIZES, dtype=torch.float32)
    cache.lengths.copy_(torch.tensor([2, 0, 5, 1]))
    cache.select([2, 0], kv_len=7)
    mask = cache.attention_mask(2, torch.float32)
    assert mask.shape == (2, 1, 2, 7)
    for index, start in enumerate([5, 2]):
        for t in range(2):
            visible = (mask[index, 0, t] == 0).nonzero().flatten().tolist()
            assert visible == list(range(start + t + 1))
    assert cache.positions(2).tolist() == [[5, 6], [2, 3]]
