"""How a split attention block sees its share of the heads.

AutoTP rewrites a block's head-count attributes (``num_heads``, ``num_key_value_heads``, and
``hidden_size`` where it is the attention width) to this rank's share, only on the modules that
directly hold split layers; a block that reads the counts from the model config at every forward
(Phi-3) gets a view of the config with this rank's counts (`_RankConfig`), and a block handed a
per-head bias built for every head (Bloom's ALiBi) narrows it to its own heads (`narrow_alibi`).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

from deepshard.autotp._plan_types import LayerPlan, Style
from deepshard.interface.errors import ConfigError

__all__ = ["Q_HEADS", "count", "narrow_alibi", "rewrite_heads"]

Q_HEADS = ("num_heads", "num_attention_heads")
_KV_HEADS = ("num_key_value_heads", "num_kv_heads")
_WIDTH = "hidden_size"


class _NarrowAlibi:
    """A forward pre-hook: an ALiBi bias built by the model for every head (Bloom builds it
    once, ``[batch · heads, 1, keys]``, in the model's forward) narrowed to this rank's heads
    ``[first, first + count)``, whose slopes it must keep."""

    def __init__(self, first: int, count: int, total: int) -> None:
        self.first, self.count, self.total = first, count, total

    def __call__(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        if "alibi" in kwargs:
            return args, {**kwargs, "alibi": self._narrow(kwargs["alibi"])}
        at = _ALIBI_AT
        return (*args[:at], self._narrow(args[at]), *args[at + 1 :]), kwargs

    def _narrow(self, alibi: torch.Tensor) -> torch.Tensor:
        heads = alibi.view(-1, self.total, *alibi.shape[1:])
        mine = heads[:, self.first : self.first + self.count]
        return mine.reshape(-1, *alibi.shape[1:])


_ALIBI_AT = 2
"""Where a Bloom-style attention takes ``alibi`` positionally: after the hidden states and the
residual."""


def narrow_alibi(block: nn.Module, q: LayerPlan, heads: int | None, rank: int) -> None:
    """Narrow a block's ``alibi`` argument to this rank's heads (see `_NarrowAlibi`); ``q`` is
    its fused, head-by-head QKV layer, ``heads`` its head count before the split."""
    forward = inspect.signature(block.forward).parameters
    if "alibi" not in forward or heads is None or len(q.sizes) != 1:
        return
    if list(forward).index("alibi") != _ALIBI_AT:
        raise ConfigError(
            f"{type(block).__name__} takes alibi at position {list(forward).index('alibi')}, "
            f"not {_ALIBI_AT} as Bloom's attention does; AutoTP cannot narrow its ALiBi bias "
            "to each rank's heads: give this model no tensor parallelism",
            [("tensor_parallel.autotp_size", "an unknown ALiBi attention")],
        )
    rows = _total(q) // heads
    ((start, length),) = q.offsets(rank)
    if length:
        block.register_forward_pre_hook(
            _NarrowAlibi(start // rows, length // rows, heads), with_kwargs=True
        )


def count(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


class _RankConfig:
    """A model config as one attention block of this rank sees it: its own head counts, and
    every other attribute read from (and written to) the shared config, so a later change of
    the model's config (its attention implementation) still reaches the block."""

    def __init__(self, config: object, heads: dict[str, int]) -> None:
        object.__setattr__(self, "_shared", config)
        object.__setattr__(self, "_heads", heads)

    def __getattr__(self, name: str) -> Any:
        heads = object.__getattribute__(self, "_heads")
        if name in heads:
            return heads[name]
        return getattr(object.__getattribute__(self, "_shared"), name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(object.__getattribute__(self, "_shared"), name, value)


def _shares(layer: LayerPlan, part: int, rank: int) -> tuple[int, int]:
    """(rows of ``part`` this rank holds, rows of ``part``), or of the whole layer when it has
    one part."""
    if len(layer.sizes) == 1:
        return layer.local_size(rank), _total(layer)
    per_rank = layer.sizes[part]
    return per_rank[rank], sum(per_rank)


def rewrite_heads(block: nn.Module, layers: list[LayerPlan], rank: int) -> None:
    """Scale the block's head-count attributes to this rank's share (see module doc)."""
    columns = [layer for layer in layers if layer.style is Style.COLUMN]
    if not columns:
        return
    q = columns[0]
    kv = columns[1] if len(columns) > 1 else q
    fused = len(columns) == 1 and len(q.sizes) == 3  # one q, k, v weight: parts 0 and 1
    shares = {"q": _shares(q, 0, rank) if fused else (q.local_size(rank), _total(q))}
    shares["kv"] = _shares(kv, 1, rank) if fused else (kv.local_size(rank), _total(kv))
    has_heads = any(count(getattr(block, attr, None)) for attr in Q_HEADS)
    if has_heads and getattr(block, _WIDTH, None) == _total(q):
        setattr(block, _WIDTH, q.local_size(rank))  # the attention width, not the residual one
    for names, key in ((Q_HEADS, "q"), (_KV_HEADS, "kv")):
        local, total = shares[key]
        for attr in names:
            value = count(getattr(block, attr, None))
            if value is not None:
                setattr(block, attr, value * local // total)
    _rewrite_config_heads(block, shares)


def _rewrite_config_heads(block: nn.Module, shares: dict[str, tuple[int, int]]) -> None:
    """Give a block that holds the model config (Phi-3's attention reads its query width from
    ``config.num_attention_heads`` at every forward) a view of it with this rank's counts."""
    config = getattr(block, "config", None)
    if config is None or isinstance(config, _RankConfig):
        return
    heads = {}
    for names, key in ((Q_HEADS, "q"), (_KV_HEADS, "kv")):
        local, total = shares[key]
        for attr in names:
            value = count(getattr(config, attr, None))
            if value is not None:
                heads[attr] = value * local // total
    if heads:
        setattr(block, "config", _RankConfig(config, heads))  # noqa: B010 (Module typing)


def _total(layer: LayerPlan) -> int:
    return sum(sum(per_rank) for per_rank in layer.sizes)
