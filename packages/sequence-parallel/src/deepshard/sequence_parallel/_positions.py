"""Global positions and the attention mask of the whole sequence, from sharded position ids.

Under Ulysses each rank holds ``S/P`` consecutive tokens of every sample, but core attention
runs on the whole sequence (for ``H/P`` heads). A mask the model built for its local shard
therefore has the wrong shape, and a full ``[S, S]`` mask per layer costs O(S²) memory, so the
Hugging Face wrapper ignores the model's mask and derives the one it needs from the position
ids, which are O(S): the shards' ids are gathered (rank order is sequence order), and

* when every row is ``0, 1, ..., S-1`` attention is plainly causal (no mask for sdpa, which
  then takes its ``is_causal`` path);
* otherwise the row packs several documents, each starting where a position does not follow
  its predecessor (``pos[t] != pos[t-1] + 1``), and a query sees keys at or before it in its
  own document.

Padding is handled by the labels and by right-padding: a causal query never sees the padding
after it (`UlyssesDataLoaderAdapter` refuses left-padded attention masks).
"""

from __future__ import annotations

from typing import Literal

import torch
from torch.distributed.device_mesh import DeviceMesh

from deepshard.comm import all_gather_into_tensor
from deepshard.interface.errors import ConfigError

__all__ = ["MaskKind", "gather_positions", "mask_from_positions"]

MaskKind = Literal["bool", "additive"]
"""How a core attention reads its mask: sdpa takes booleans (True attends), eager adds it."""


def gather_positions(position_ids: torch.Tensor, *, group: DeviceMesh) -> torch.Tensor:
    """Every rank's shard of ``position_ids`` ``[b, s/P]``, concatenated to ``[b, S]``.

    Args:
        position_ids: This rank's position ids, ``[b, s/P]`` (or ``[s/P]``, one row for all).
        group: The ``sp`` group (a 1-D mesh); its rank order is the sequence order.

    Returns:
        The global position ids ``[b, S]`` (``[1, S]`` for a 1-D input).
    """
    local = position_ids if position_ids.dim() == 2 else position_ids.reshape(1, -1)
    size = group.size()
    if size == 1:
        return local
    stacked = local.new_empty((size, *local.shape))
    all_gather_into_tensor(local.contiguous(), group=group, output=stacked).wait()
    return stacked.permute(1, 0, 2).reshape(local.shape[0], size * local.shape[1])


def _is_plain_arange(positions: torch.Tensor) -> bool:
    expected = torch.arange(positions.shape[1], device=positions.device, dtype=positions.dtype)
    return bool((positions == expected).all())


def mask_from_positions(
    positions: torch.Tensor, *, kind: MaskKind, dtype: torch.dtype
) -> torch.Tensor | None:
    """The causal, document-aware mask of a whole sequence, or None where plain causal will do.

    Args:
        positions: Global position ids ``[b, S]`` (`gather_positions`).
        kind: ``"bool"`` (sdpa: True attends; None when the rows are plain ``arange``) or
            ``"additive"`` (eager: 0 attends, the dtype's minimum blocks; always a tensor,
            since eager has no causal path of its own).
        dtype: The query dtype (the additive mask's dtype).

    Returns:
        ``[b, 1, S, S]``, or None.

    Raises:
        ConfigError: ``positions`` is not ``[b, S]``.
    """
    if positions.dim() != 2:
        raise ConfigError(
            f"position_ids must be [batch, seq], got shape {tuple(positions.shape)}; pass "
            "position_ids of shape [batch, seq] (UlyssesDataLoaderAdapter adds them)"
        )
    plain = _is_plain_arange(positions)
    if plain and kind == "bool":
        return None
    seq = positions.shape[1]
    index = torch.arange(seq, device=positions.device)
    allowed = index[None, :] <= index[:, None]  # key k visible from query q when k <= q
    if not plain:
        starts = torch.ones_like(positions, dtype=torch.bool)
        starts[:, 1:] = positions[:, 1:] != positions[:, :-1] + 1
        document = starts.cumsum(dim=1)
        allowed = allowed[None] & (document[:, :, None] == document[:, None, :])
    mask = allowed.expand(positions.shape[0], seq, seq).unsqueeze(1)
    if kind == "bool":
        return mask
    blocked = torch.finfo(dtype).min
    return torch.zeros(mask.shape, dtype=dtype, device=positions.device).masked_fill(~mask, blocked)
