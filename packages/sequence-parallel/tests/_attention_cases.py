"""Shared inputs and the single-process reference of the DistributedAttention tests.

Inputs are generated batch-first `[b, s, h, d]` in fp64 from a seed; the seq-first case feeds
their `transpose(0, 1)`. The reference is causal SDPA with GQA on the full sequence in one
process; rank `r` of `P` feeds sequence shard `r` and must reproduce the matching slice of the
reference output and of its q/k/v gradients (upstream gradient random, not all ones).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

Tensors = dict[str, torch.Tensor]


def sdpa_local(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch_dim_idx: int
) -> torch.Tensor:
    """Causal SDPA with GQA on `[b, s, h, d]` (0) or `[s, b, h, d]` (1) tensors."""
    if batch_dim_idx == 0:
        to_bhsd, back = (0, 2, 1, 3), (0, 2, 1, 3)
    else:
        to_bhsd, back = (1, 2, 0, 3), (2, 0, 1, 3)
    out = F.scaled_dot_product_attention(
        q.permute(to_bhsd), k.permute(to_bhsd), v.permute(to_bhsd), is_causal=True, enable_gqa=True
    )
    return out.permute(back)


def inputs(seed: int, q_heads: int, kv_heads: int, b: int = 2, s: int = 8, d: int = 16) -> Tensors:
    """q, k, v and the upstream gradient `go`, batch-first, fp64."""
    gen = torch.Generator().manual_seed(seed)

    def rand(h: int) -> torch.Tensor:
        return torch.randn(b, s, h, d, generator=gen, dtype=torch.float64)

    return {"q": rand(q_heads), "k": rand(kv_heads), "v": rand(kv_heads), "go": rand(q_heads)}


def in_layout(t: torch.Tensor, batch_dim_idx: int) -> torch.Tensor:
    """A batch-first tensor in the given layout (seq-first is the transpose of dims 0, 1)."""
    return t if batch_dim_idx == 0 else t.transpose(0, 1).contiguous()


def seq_shard(t: torch.Tensor, batch_dim_idx: int, rank: int, world: int) -> torch.Tensor:
    """Rank `rank`'s sequence shard of a tensor already in the given layout."""
    seq_dim = 1 - batch_dim_idx
    return t.chunk(world, dim=seq_dim)[rank].contiguous()


def reference(data: Tensors, batch_dim_idx: int) -> Tensors:
    """Output and q/k/v gradients of one process on the full sequence, in the given layout."""
    q, k, v = (in_layout(data[n], batch_dim_idx).requires_grad_() for n in ("q", "k", "v"))
    out = sdpa_local(q, k, v, batch_dim_idx)
    out.backward(in_layout(data["go"], batch_dim_idx))
    assert q.grad is not None and k.grad is not None and v.grad is not None
    return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


def shard_inputs(data: Tensors, batch_dim_idx: int, rank: int, world: int) -> Tensors:
    """This rank's shard of every input, as fresh leaves (`go` without grad)."""
    out = {}
    for name, t in data.items():
        shard = seq_shard(in_layout(t, batch_dim_idx), batch_dim_idx, rank, world)
        out[name] = shard if name == "go" else shard.requires_grad_()
    return out


def expected_shard(ref: Tensors, batch_dim_idx: int, rank: int, world: int) -> Tensors:
    """The slice of the reference that rank `rank` must produce."""
    return {n: seq_shard(t, batch_dim_idx, rank, world) for n, t in ref.items()}
