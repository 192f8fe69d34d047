"""A static KV cache whose rows advance independently, for continuous batching.

Each layer keeps one key and one value tensor of shape ``[batch, kv_heads, max_len, head_dim]``,
allocated once. Row ``b`` holds one sequence; ``lengths[b]`` is how many of its slots are written
(its next write position). Rows are independent: a row admitted later starts at 0 while its
neighbours are deep into decoding, so no prompt is padded to the longest one.

The cache plugs into Hugging Face models through transformers 5's public ``Cache`` interface:
their attention calls ``past_key_values.update(key, value, layer_idx)`` and attends over what it
returns. Before each forward the generation loop calls `StaticKVCache.select` with the rows the
forward's batch maps to; ``update`` then writes the new keys of batch entry ``i`` at row
``rows[i]``, positions ``lengths[rows[i]] + 0..q-1``, and returns those rows' first ``kv_len``
slots. When the rows are a span ``first..first+n-1`` (the usual case: a full batch, one
admitted row, the compacted tail) the write is one ``scatter_`` per tensor into the span's view,
with an index built once per forward and shared by the layers, and the returned slots are views;
other selections use advanced indexing and a gather. The loop passes the matching explicit
``position_ids`` and a 4-D mask hiding every slot a row has not written
(`StaticKVCache.attention_mask`), and calls `StaticKVCache.advance` after the forward.
``lengths`` is one tensor moved in place, so a captured graph sees it move.

``head_dim`` comes from ``config.head_dim`` when the config has one (Qwen3: hidden 64, 4 heads,
head_dim 32), else ``hidden_size // num_attention_heads`` — DeepSpeed sized its cache with the
latter always, which is wrong for such models.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from deepshard.interface.errors import ConfigError

__all__ = ["StaticKVCache", "head_dim_of"]


def head_dim_of(config: Any) -> int:
    """Returns a model config's attention head size.

    ``config.head_dim`` when set (it may differ from ``hidden_size // num_attention_heads``),
    otherwise ``hidden_size // num_attention_heads``.
    """
    head_dim = getattr(config, "head_dim", None)
    if head_dim:
        return int(head_dim)
    hidden, heads = (
        getattr(config, "hidden_size", None),
        getattr(config, "num_attention_heads", None),
    )
    if not hidden or not heads:
        raise ConfigError(
            f"{type(config).__name__} has neither head_dim nor hidden_size and "
            "num_attention_heads; "
            "cannot size a KV cache for it"
        )
    return int(hidden) // int(heads)


class _RowLayer(CacheLayerMixin):  # type: ignore[no-untyped-call]
    """One layer's keys and values; writes go to the rows its owner selected."""

    is_sliding = False

    def __init__(self, owner: StaticKVCache, keys: torch.Tensor, values: torch.Tensor) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.owner = owner
        self.keys, self.values = keys, values
        self.row_keys, self.row_values = keys, values  # the same tensors, typed non-optional
        self.max_len = keys.shape[2]
        self.is_initialized = True
        self.updates = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        return None  # allocated up front

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        rows, kv_len = self.owner.selected()
        keys, values = self.row_keys, self.row_values
        if key_states.shape[0] != rows.numel():
            raise ValueError(
                f"the forward's batch has {key_states.shape[0]} rows but StaticKVCache.select "
                f"chose {rows.numel()}; select the rows of each forward before calling the model"
            )
        self.updates += 1
        span = self.owner.span()
        if span is not None:  # rows first..first+n-1: one scatter into a view, views back
            first, n = span
            index = self.owner.write_index(key_states.shape)
            keys[first : first + n].scatter_(2, index, key_states.to(keys.dtype))
            values[first : first + n].scatter_(2, index, value_states.to(values.dtype))
            return keys[first : first + n, :, :kv_len], values[first : first + n, :, :kv_len]
        q = key_states.shape[2]
        positions = self.owner.lengths[rows].unsqueeze(1) + torch.arange(q, device=rows.device)
        where = (rows.unsqueeze(1), slice(None), positions)
        keys[where] = key_states.transpose(1, 2).to(keys.dtype)
        values[where] = value_states.transpose(1, 2).to(values.dtype)
        return keys[rows, :, :kv_len], values[rows, :, :kv_len]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.max_len, 0

    def get_seq_length(self) -> int:
        return int(self.owner.lengths.max().item())

    def get_max_length(self) -> int:
        return self.max_len


class StaticKVCache(Cache):
    """Preallocated per-layer keys and values with a write position per row.

    Attributes:
        keys: Per layer, ``[batch, kv_heads, max_len, head_dim]``.
        values: Per layer, same shape as ``keys``.
        lengths: ``int64 [batch]``, the number of written slots of each row (moved in place).
    """

    def __init__(
        self,
        *,
        num_layers: int,
        batch_size: int,
        kv_heads: int,
        max_len: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> None:
        sizes = {"num_layers": num_layers, "batch_size": batch_size, "kv_heads": kv_heads}
        sizes |= {"max_len": max_len, "head_dim": head_dim}
        bad = [f"{name}={value}" for name, value in sizes.items() if value <= 0]
        if bad:
            raise ConfigError(f"StaticKVCache sizes must be positive, got {', '.join(bad)}")
        shape = (batch_size, kv_heads, max_len, head_dim)
        layers: list[_RowLayer] = []
        for _ in range(num_layers):
            keys = torch.zeros(shape, dtype=dtype, device=device)
            layers.append(_RowLayer(self, keys, torch.zeros_like(keys)))
        super().__init__(layers=list(layers))
        self._row_layers = layers
        self.max_len = max_len
        self.lengths = torch.zeros(batch_size, dtype=torch.int64, device=device)
        self._rows = torch.arange(batch_size, device=device)
        self._kv_len = max_len
        self._span: tuple[int, int] | None = (0, batch_size)
        self._write_index: torch.Tensor | None = None
        self._slots = torch.arange(max_len, device=device)

    @classmethod
    def for_model(
        cls,
        model_config: Any,
        *,
        batch_size: int,
        max_len: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        kv_heads: int | None = None,
    ) -> StaticKVCache:
        """Sizes a cache from a Hugging Face model config.

        ``head_dim`` is `head_dim_of` the config; ``kv_heads`` defaults to
        ``num_key_value_heads`` (or ``num_attention_heads``). Under tensor parallelism the caller
        passes its rank's local KV-head count.
        """
        if kv_heads is None:
            kv_heads = getattr(model_config, "num_key_value_heads", None)
            kv_heads = kv_heads or model_config.num_attention_heads
        return cls(
            num_layers=int(model_config.num_hidden_layers),
            batch_size=batch_size,
            kv_heads=int(kv_heads),
            max_len=max_len,
            head_dim=head_dim_of(model_config),
            dtype=dtype,
            device=device,
        )

    @property
    def keys(self) -> list[torch.Tensor]:
        return [layer.row_keys for layer in self._row_layers]

    @property
    def values(self) -> list[torch.Tensor]:
        return [layer.row_values for layer in self._row_layers]

    @property
    def batch_size(self) -> int:
        return int(self.lengths.numel())

    def select(self, rows: Sequence[int] | torch.Tensor, kv_len: int | None = None) -> None:
        """Maps the next forward's batch entries to cache rows.

        Args:
            rows: Cache row of each batch entry, in batch order.
            kv_len: Slots returned to attention (default ``max_len``); must cover every selected
                row's length after the write.
        """
        device = self.lengths.device
        self._rows = torch.as_tensor(rows, dtype=torch.int64, device=device).reshape(-1)
        listed = rows.tolist() if isinstance(rows, torch.Tensor) else list(rows)
        first = listed[0] if listed else 0
        contiguous = listed == list(range(first, first + len(listed)))
        self._span = (first, len(listed)) if contiguous else None
        self._write_index = None
        self._kv_len = self.max_len if kv_len is None else min(int(kv_len), self.max_len)

    def prefix(self) -> int | None:
        """``n`` when the last `select` chose rows ``0..n-1`` in order, else ``None``."""
        return self._span[1] if self._span is not None and self._span[0] == 0 else None

    def span(self) -> tuple[int, int] | None:
        """``(first, n)`` when the last `select` chose rows ``first..first+n-1`` in order."""
        return self._span

    def write_index(self, shape: torch.Size) -> torch.Tensor:
        """The ``scatter_`` index ``[n, kv_heads, q, head_dim]`` of the next write, along dim 2.

        Entry ``[i, :, t, :]`` is ``lengths[rows[i]] + t``. Built once per `select` and shared
        by every layer (``lengths`` only moves in `advance`, after the forward).
        """
        if self._write_index is None or self._write_index.shape != shape:
            n, heads, q, head_dim = shape
            positions = self.lengths[self._rows].unsqueeze(1) + self._slots[:q]
            self._write_index = positions.view(n, 1, q, 1).expand(n, heads, q, head_dim)
        return self._write_index

    def selected(self) -> tuple[torch.Tensor, int]:
        """Returns the rows and the attended length chosen by the last `select`."""
        return self._rows, self._kv_len

    def attention_mask(self, query_len: int, dtype: torch.dtype) -> torch.Tensor:
        """A 4-D additive mask ``[rows, 1, query_len, kv_len]`` for the selected rows.

        Query ``t`` of a row sees the slots up to and including its own position
        (``lengths[row] + t``); later and unwritten slots get the dtype's lowest value.
        """
        rows, kv_len = self._rows, self._kv_len
        last = self.lengths[rows].unsqueeze(1) + self._slots[:query_len]
        hidden = self._slots[:kv_len].view(1, 1, 1, -1) > last[:, None, :, None]
        return torch.zeros(hidden.shape, dtype=dtype, device=hidden.device).masked_fill_(
            hidden, torch.finfo(dtype).min
        )

    def positions(self, query_len: int) -> torch.Tensor:
        """Explicit ``position_ids [rows, query_len]`` of the next write of the selected rows."""
        start = self.lengths[self._rows].unsqueeze(1)
        return start + self._slots[:query_len]

    def advance(self, query_len: int | Sequence[int]) -> None:
        """Moves the selected rows' write positions past the forward just run.

        Args:
            query_len: Tokens written per row: one count for all rows, or one per selected
                row (a right-padded batch: only each row's real tokens count as written; its
                pad slots stay hidden by the mask and are overwritten by later writes).
        """
        if isinstance(query_len, int):
            self.lengths.index_add_(0, self._rows, torch.full_like(self._rows, query_len))
        else:
            counts = torch.as_tensor(list(query_len), dtype=torch.int64, device=self._rows.device)
            self.lengths.index_add_(0, self._rows, counts)
        self._write_index = None

    def compact(self, active_rows: Sequence[int]) -> None:
        """Moves the rows ``active_rows`` to the front, in that order, and zeroes the rest.

        Keys, values and ``lengths`` are rewritten in place (the tensors keep their storage).
        """
        order = torch.as_tensor(list(active_rows), dtype=torch.int64, device=self.lengths.device)
        if order.numel() != len(set(order.tolist())):
            raise ValueError(f"compact got repeated rows {list(active_rows)}")
        n = order.numel()
        self._write_index = None
        for tensor in [*self.keys, *self.values, self.lengths]:
            kept = tensor[order].clone()
            tensor[n:].zero_()
            tensor[:n].copy_(kept)

    def reset_rows(self, rows: Sequence[int]) -> None:
        """Empties the given rows: zero keys and values, length 0."""
        index = torch.as_tensor(list(rows), dtype=torch.int64, device=self.lengths.device)
        self._write_index = None
        for tensor in [*self.keys, *self.values, self.lengths]:
            tensor[index] = 0

    def trim_left(self, n: int) -> None:
        """Drops the first ``n`` slots of every row, shifting the rest left.

        Rows shorter than ``n`` become empty; the freed tail is zeroed and ``lengths`` drop by
        ``n`` (not below 0). Positions already encoded in the keys (RoPE) are kept as they are.
        """
        if n < 0:
            raise ValueError(f"trim_left needs n >= 0, got {n}")
        n = min(n, self.max_len)
        self._write_index = None
        for tensor in [*self.keys, *self.values]:
            kept = tensor[:, :, n:].clone()
            tensor[:, :, kept.shape[2] :].zero_()
            tensor[:, :, : kept.shape[2]].copy_(kept)
        self.lengths.sub_(n).clamp_(min=0)

    def layer_updates(self) -> list[int]:
        """How many ``update`` calls each layer has received (to detect models that ignore it)."""
        return [layer.updates for layer in self._row_layers]
