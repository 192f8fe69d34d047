"""`DistributedAttention`: Ulysses sequence parallelism around any local attention.

Each rank of the sequence-parallel group holds a sequence shard of q, k and v with every head.
The module exchanges them (scatter heads, gather sequence; see `_layout`) so that each rank
holds the full sequence for its share of the heads, runs the caller's local attention there,
and exchanges the output back to the caller's sequence shard with every head. Attention is
exact: every query position sees every key position of its head.

The head split follows the KV heads (see `_heads`): under GQA each query head stays on the
rank of its KV head; uneven counts use variable all-to-all splits; fewer KV heads than ranks
are replicated when the ranks divide by them. The KV head count is this instance's
(`num_kv_heads`) or read from `k.shape` on each call; the plan derived from it is part of
that call's autograd graph (the exchange op's arguments), so backward replays it and nothing
is shared between instances (DeepSpeed once kept it process-wide and split the second model's
GQA queries wrong, v0.19.7 #8316).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from deepshard.comm import resolve_group
from deepshard.interface.errors import ConfigError
from deepshard.sequence_parallel._heads import HeadPlan, plan_heads
from deepshard.sequence_parallel._layout import ExchangeSpec, gather_heads, scatter_heads
from deepshard.sequence_parallel._overlap import scatter_heads_overlapped

__all__ = ["DistributedAttention"]

_HEAD_DIM = 2  # heads are dim 2 in both layouts: [b, s, h, d] and [s, b, h, d]


def _sequence_group(mesh_or_group: DeviceMesh | dist.ProcessGroup) -> dist.ProcessGroup:
    # A mesh with an "sp" axis stands for that axis; a 1-D mesh or a group for itself.
    if isinstance(mesh_or_group, DeviceMesh) and mesh_or_group.ndim > 1:
        names = mesh_or_group.mesh_dim_names or ()
        if "sp" not in names:
            raise ConfigError(
                f"DistributedAttention got a mesh with axes {names} and no 'sp' axis; pass "
                "mesh['sp'] (or the sequence-parallel process group)."
            )
        return resolve_group(mesh_or_group["sp"])
    return resolve_group(mesh_or_group)


class DistributedAttention(torch.nn.Module):
    """Ulysses attention: all-to-all q/k/v to full sequence, local attention, all-to-all back.

    Args:
        local_attention: Called as `local_attention(q, k, v, *args, **kwargs)` on the full
            sequence and this rank's heads, in the caller's layout (`[b, s, h_r, d]` or
            `[s, b, h_r, d]`; k/v with this rank's KV heads); returns the same layout as `q`.
        mesh_or_group: The sequence-parallel group: a ProcessGroup, a 1-D mesh, or a mesh with
            an `"sp"` axis.
        scatter_idx: The head dim the input exchange scatters; must be 2 (DeepSpeed's default).
        gather_idx: DeepSpeed's gather index (0 or 1); the gathered sequence dim is the one of
            `{0, 1}` that `batch_dim_idx` does not name.
        num_kv_heads: KV heads of the layer before sharding; `None` reads `k.shape[2]` on each
            call.
        overlap: Launch the backward q/k exchanges asynchronously and finish them in tensor
            hooks (eager mode; compiled code uses the synchronous op).

    Raises:
        ConfigError: On a bad index, a non-positive `num_kv_heads`, or a mesh without `"sp"`.
    """

    def __init__(
        self,
        local_attention: Callable[..., torch.Tensor],
        mesh_or_group: DeviceMesh | dist.ProcessGroup,
        scatter_idx: int = 2,
        gather_idx: int = 0,
        num_kv_heads: int | None = None,
        overlap: bool = False,
    ) -> None:
        super().__init__()
        if scatter_idx != _HEAD_DIM or gather_idx not in (0, 1):
            raise ConfigError(
                f"DistributedAttention(scatter_idx={scatter_idx}, gather_idx={gather_idx}): the "
                "exchange scatters heads (scatter_idx=2) and gathers the sequence (gather_idx 0 "
                "or 1); the layout of each call is given by forward's batch_dim_idx."
            )
        if num_kv_heads is not None and num_kv_heads < 1:
            raise ConfigError(f"num_kv_heads must be a positive head count, got {num_kv_heads}.")
        self.local_attention = local_attention
        self.scatter_idx = scatter_idx
        self.gather_idx = gather_idx
        self.num_kv_heads = num_kv_heads
        self.overlap = overlap
        pg = _sequence_group(mesh_or_group)
        # Read once, outside any compiled region: the exchange op addresses its group by name.
        self._group_name: str = pg.group_name
        self._rank: int = pg.rank()
        self._world_size: int = pg.size()

    @property
    def world_size(self) -> int:
        """Ranks in the sequence-parallel group."""
        return self._world_size

    def plan(self, num_q_heads: int, num_kv_heads: int) -> HeadPlan:
        """The head split of a call with these counts (see `plan_heads`)."""
        return plan_heads(num_q_heads, num_kv_heads, self._world_size)

    def _check(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch_dim_idx: int) -> int:
        if batch_dim_idx not in (0, 1):
            raise ConfigError(
                f"batch_dim_idx must be 0 (batch-first [b, s/P, h, d]) or 1 (seq-first "
                f"[s/P, b, h, d]), got {batch_dim_idx}."
            )
        if q.dim() != 4 or k.dim() != 4 or v.shape != k.shape:
            raise ConfigError(
                f"DistributedAttention needs 4-D q/k/v with v shaped like k, got q "
                f"{tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}."
            )
        if q.shape[:2] != k.shape[:2]:
            raise ConfigError(
                f"q {tuple(q.shape)} and k {tuple(k.shape)} must agree in their batch and "
                "sequence dims (0 and 1)."
            )
        kv = k.shape[_HEAD_DIM]
        if self.num_kv_heads is not None and self.num_kv_heads != kv:
            raise ConfigError(
                f"DistributedAttention(num_kv_heads={self.num_kv_heads}) got k with {kv} heads "
                "in dim 2; pass k before sharding heads, or fix num_kv_heads."
            )
        return kv

    def _spec(self, batch_dim_idx: int, splits: tuple[int, ...]) -> ExchangeSpec:
        return ExchangeSpec(self._group_name, self._rank, self._world_size, batch_dim_idx, splits)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        batch_dim_idx: int,
        *args: Any,
        **kwargs: Any,
    ) -> torch.Tensor:
        """Attention over the full sequence of this rank's sequence shard.

        Every rank of the group calls it with a sequence shard of the same length (`s/P`);
        head counts may be uneven.

        Args:
            q: `[b, s/P, h, d]` (`batch_dim_idx=0`) or `[s/P, b, h, d]` (`batch_dim_idx=1`).
            k: Same layout with the layer's KV heads.
            v: Shaped like `k`.
            batch_dim_idx: Which dim of q/k/v is the batch.
            *args: Passed to the local attention.
            **kwargs: Passed to the local attention.

        Returns:
            The attention output for this rank's sequence shard, in `q`'s layout.

        Raises:
            ConfigError: On bad shapes or a head split that cannot keep GQA groups together.
        """
        kv = self._check(q, k, v, batch_dim_idx)
        plan = self.plan(q.shape[_HEAD_DIM], kv)
        q_spec = self._spec(batch_dim_idx, plan.q_splits)
        kv_spec = self._spec(batch_dim_idx, plan.kv_splits)
        if plan.kv_repeat > 1:
            k = k.repeat_interleave(plan.kv_repeat, dim=_HEAD_DIM)
            v = v.repeat_interleave(plan.kv_repeat, dim=_HEAD_DIM)
        overlap = self.overlap and not torch.compiler.is_compiling()
        scatter_qk = scatter_heads_overlapped if overlap else scatter_heads
        q_local = scatter_qk(q, q_spec)
        k_local = scatter_qk(k, kv_spec)
        v_local = scatter_heads(v, kv_spec)
        out = self.local_attention(q_local, k_local, v_local, *args, **kwargs)
        if not isinstance(out, torch.Tensor) or out.shape[:3] != q_local.shape[:3]:
            got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
            raise ConfigError(
                f"local_attention must return one tensor in the layout of its q "
                f"{tuple(q_local.shape)} (same first three dims), got {got}."
            )
        return gather_heads(out, q_spec)
