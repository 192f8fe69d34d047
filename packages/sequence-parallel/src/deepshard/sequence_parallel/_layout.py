"""The Ulysses exchange of one tensor: heads for sequence and back, in both layouts.

A rank holds `[b, s/P, h, d]` (batch-first, `batch_dim_idx=0`) or `[s/P, b, h, d]`
(seq-first, `batch_dim_idx=1`): its sequence shard with every head. Attention needs the full
sequence for a subset of heads, so:

* **scatter heads, gather sequence** (`scatter_heads`): move heads to dim 0, all-to-all with
  input splits = the heads each rank computes (the head plan) and output splits = this rank's
  heads from each rank; what arrives from rank `j` is sequence shard `j`, so the result is
  `[P, h_r, ...]`, and a permute puts the `P` shards next to the local sequence dim, giving
  `[b, s, h_r, d]` or `[s, b, h_r, d]` (the layout the caller used, never another: writing
  the seq-first result batch-first was DeepSpeed's #8317).
* **scatter sequence, gather heads** (`gather_heads`): the exact inverse; the sequence dim is
  cut into `P` chunks in rank order, moved to dim 0 with this rank's heads behind them, sent
  chunk `j` to rank `j`, and the received head blocks (rank order = head order) moved back to
  dim 2.

Every step is a view, `reshape`, permute or the registered exchange op, so autograd (and
`torch.compile`) differentiate the whole thing; each direction's backward is the other one.
The pack and unpack halves are separate functions because the overlapped backward launches the
collective between them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepshard.sequence_parallel._exchange_op import exchange

__all__ = [
    "ExchangeSpec",
    "gather_heads",
    "pack_seq_chunks",
    "scatter_heads",
    "unpack_gathered_heads",
]


@dataclass(frozen=True)
class ExchangeSpec:
    """What one tensor's exchange needs to know: its group, its layout and its head split."""

    group_name: str
    """`ProcessGroup.group_name` of the sequence-parallel group."""

    rank: int
    """This process's rank in that group."""

    world_size: int
    """Ranks in the group (`P`)."""

    batch_dim_idx: int
    """0 for batch-first `[b, s, h, d]`, 1 for seq-first `[s, b, h, d]`."""

    head_splits: tuple[int, ...]
    """Heads of this tensor computed by each group rank (from the head plan)."""

    @property
    def local_heads(self) -> int:
        """Heads this rank computes."""
        return self.head_splits[self.rank]


def _pack_heads_first(x: torch.Tensor) -> torch.Tensor:
    # [b, s/P, h, d] or [s/P, b, h, d] -> [h, ..., d]: rows of dim 0 are whole heads.
    return x.movedim(2, 0).contiguous()


def _unpack_gathered_seq(y: torch.Tensor, spec: ExchangeSpec) -> torch.Tensor:
    # y: [P * h_r, A, B, d] where block j came from rank j and holds sequence shard j.
    p, h = spec.world_size, spec.local_heads
    blocks = y.reshape(p, h, *y.shape[1:])  # [P, h_r, A, B, d]
    if spec.batch_dim_idx == 0:  # A, B = b, s/P -> [b, P, s/P, h_r, d]
        out = blocks.permute(2, 0, 3, 1, 4)
        return out.reshape(out.shape[0], p * out.shape[2], h, out.shape[4])
    out = blocks.permute(0, 2, 3, 1, 4)  # A, B = s/P, b -> [P, s/P, b, h_r, d]
    return out.reshape(p * out.shape[1], out.shape[2], h, out.shape[4])


def pack_seq_chunks(y: torch.Tensor, spec: ExchangeSpec) -> torch.Tensor:
    """`[b, s, h_r, d]` / `[s, b, h_r, d]` as `[P * h_r, A, B, d]`, chunk `j` for rank `j`.

    `A, B` are `b, s/P` (batch-first) or `s/P, b` (seq-first), the sender's local layout.
    """
    p = spec.world_size
    if spec.batch_dim_idx == 0:
        b, s, h, d = y.shape
        chunks = y.reshape(b, p, s // p, h, d).permute(1, 3, 0, 2, 4)
    else:
        s, b, h, d = y.shape
        chunks = y.reshape(p, s // p, b, h, d).permute(0, 3, 1, 2, 4)
    return chunks.reshape(p * h, *chunks.shape[2:])


def unpack_gathered_heads(x: torch.Tensor) -> torch.Tensor:
    """`[h, A, B, d]` (heads in rank order) back to the caller's `[A, B, h, d]`."""
    return x.movedim(0, 2)


def scatter_heads(x: torch.Tensor, spec: ExchangeSpec) -> torch.Tensor:
    """Sequence shard with all heads -> full sequence with this rank's heads (same layout).

    Args:
        x: `[b, s/P, h, d]` or `[s/P, b, h, d]`, `h == sum(spec.head_splits)`.
        spec: Group, layout and head split.

    Returns:
        `[b, s, h_r, d]` or `[s, b, h_r, d]` with `h_r = spec.local_heads`.
    """
    received = [spec.local_heads] * spec.world_size
    y = exchange(_pack_heads_first(x), spec.group_name, received, spec.head_splits)
    return _unpack_gathered_seq(y, spec)


def gather_heads(y: torch.Tensor, spec: ExchangeSpec) -> torch.Tensor:
    """Full sequence with this rank's heads -> sequence shard with all heads (inverse).

    Args:
        y: `[b, s, h_r, d]` or `[s, b, h_r, d]`, `s` divisible by the group size.
        spec: Group, layout and head split.

    Returns:
        `[b, s/P, h, d]` or `[s/P, b, h, d]`, heads in their global order.
    """
    sent = [spec.local_heads] * spec.world_size
    x = exchange(pack_seq_chunks(y, spec), spec.group_name, spec.head_splits, sent)
    return unpack_gathered_heads(x)
