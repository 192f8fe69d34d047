"""Token dispatch and combine for expert parallelism, over `deepshard.comm`'s all-to-all.

The algorithm, for ``T`` tokens each routed to ``K`` of ``E`` experts spread over ``ep`` ranks
(``E / ep`` consecutive experts per rank):

1. *Sort* (`sort_by_expert`, in `_combine`). The ``[T·K]`` (token, choice) assignments are put
   in expert-contiguous order with a *stable* sort of the expert ids, so rows of one expert keep
   their token order. ``counts[e]`` rows go to expert ``e``.
2. *Counts.* One all-to-all of the ``[ep, E / ep]`` count table tells each rank how many rows
   it will receive from every source for every local expert; the row sums are the split sizes.
3. *Dispatch.* A variable-split all-to-all sends the sorted rows (rows for rank ``j``'s experts
   are contiguous because rank ``j`` owns a contiguous range). The received rows are grouped by
   source, then by local expert; a second stable sort by local expert makes each local expert's
   rows contiguous for the grouped GEMM.
4. *Combine.* The expert outputs are put back in received order and sent back with the split
   sizes swapped; the caller undoes step 1 and sums the ``K`` weighted rows of each token
   (`combine`).

Both all-to-alls of rows are autograd all-to-alls: the backward of dispatch is the reverse
exchange (combine) of the gradient and vice versa, so nothing here needs a custom backward.
With ``ep == 1`` no collective is issued.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from deepshard.comm import Group, all_to_all_single, all_to_all_single_autograd, resolve_group
from deepshard.interface.errors import CommError

__all__ = [
    "AllToAllTransport",
    "ExchangePlan",
    "LocalOrder",
    "local_expert_order",
]


@dataclass(frozen=True)
class LocalOrder:
    """How received rows are regrouped by local expert (step 3 of the module docstring)."""

    order: torch.Tensor
    """``order[i]``: the received row that becomes the ``i``-th expert-contiguous row."""

    inverse: torch.Tensor
    """The inverse permutation (expert-contiguous position of each received row)."""

    group_sizes: torch.Tensor
    """``[E / ep]`` int64 rows per local expert."""


def local_expert_order(received_counts: torch.Tensor) -> LocalOrder:
    """Regroups rows received as (source, local expert) blocks into local-expert blocks.

    Args:
        received_counts: ``[ep, E / ep]`` rows received from each source for each local expert.
    """
    ep, per_rank = received_counts.shape
    local_ids = torch.arange(per_rank, device=received_counts.device).repeat(ep)
    row_expert = torch.repeat_interleave(local_ids, received_counts.reshape(-1))
    order = torch.argsort(row_expert, stable=True)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    return LocalOrder(order=order, inverse=inverse, group_sizes=received_counts.sum(dim=0))


@dataclass(frozen=True)
class ExchangePlan:
    """The split sizes of one dispatch, which its combine reuses swapped."""

    send_splits: tuple[int, ...]
    """Rows this rank sent to each group rank."""

    recv_splits: tuple[int, ...]
    """Rows this rank received from each group rank."""


class AllToAllTransport:
    """The default `ExpertTransport`: two all-to-alls of rows plus one of the counts.

    Args:
        group: The ``ep`` group (a 1-D DeviceMesh or a ProcessGroup), group rank ``j`` owning
            experts ``[j·E/ep, (j+1)·E/ep)``.

    Raises:
        CommError: ``group`` is not a usable group.
    """

    def __init__(self, group: Group) -> None:
        self._group = group
        self._ep = resolve_group(group).size()

    @property
    def process_group(self) -> dist.ProcessGroup:
        """The ``ep`` group as a ProcessGroup (resolved per call: a ProcessGroup cannot be
        deep-copied, and models with this transport are, e.g. into RLHF reference models)."""
        return resolve_group(self._group)

    @property
    def ep_size(self) -> int:
        """Ranks the experts are spread over."""
        return self._ep

    def exchange_counts(self, counts: torch.Tensor) -> torch.Tensor:
        """The ``[ep, E/ep]`` table of rows each source sends for each of this rank's experts."""
        if counts.numel() % self._ep:
            raise CommError(
                f"{counts.numel()} experts do not split over {self._ep} expert-parallel ranks; "
                "expert_parallel.autoep_size must divide the expert count"
            )
        table = counts.reshape(self._ep, -1).contiguous()
        if self._ep == 1:
            return table
        # Each rank sends row j (its counts for rank j's experts) to rank j.
        received = all_to_all_single(table, group=self._group).wait()
        return received

    def dispatch(
        self, rows: torch.Tensor, counts: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, ExchangePlan]:
        """Send expert-sorted rows to their experts' ranks (see `ExpertTransport.dispatch`)."""
        received_counts = self.exchange_counts(counts)
        # One host sync for both split lists (the all-to-all needs them on the host).
        splits = torch.cat([counts.reshape(self._ep, -1).sum(1), received_counts.sum(1)])
        host = [int(s) for s in splits.tolist()]
        plan = ExchangePlan(tuple(host[: self._ep]), tuple(host[self._ep :]))
        if self._ep == 1:
            return rows, received_counts, plan
        received = all_to_all_single_autograd(
            rows,
            group=self._group,
            output_split_sizes=plan.recv_splits,
            input_split_sizes=plan.send_splits,
        )
        return received, received_counts, plan

    def combine(self, rows: torch.Tensor, plan: ExchangePlan) -> torch.Tensor:
        """Send results (in received order) back to their sources, in their sorted order."""
        if self._ep == 1:
            return rows
        return all_to_all_single_autograd(
            rows,
            group=self._group,
            output_split_sizes=plan.send_splits,
            input_split_sizes=plan.recv_splits,
        )
