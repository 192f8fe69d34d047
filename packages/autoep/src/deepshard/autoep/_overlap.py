"""Expert parallelism with this rank's own rows computed while the other ranks' rows travel.

A rank's sorted rows split in two: those routed to its *own* experts (one contiguous slice,
since rank ``me`` owns experts ``[me·E/ep, (me+1)·E/ep)``) and those routed to other ranks'
experts. Only the second kind needs the network, so the exchange is arranged to hide it:

Forward, per MoE layer:

1. exchange the ``[ep, E/ep]`` count table (small, blocking: it sizes everything after);
2. *launch* the dispatch all-to-all of the remote rows (nothing is sent to oneself);
3. run the first half of the own rows through the local experts while it is in flight;
4. *land* it (wait), run the received rows through the local experts;
5. *launch* their outputs back to their sources, run the second half of the own rows;
6. *land* the results: ``[N, H]`` rows in the caller's sorted order, the own outputs in their
   slice, as `AllToAllTransport.combine` gives.

Backward mirrors it. The autograd engine runs the ready node created last first, so each
`_Land` backward (which *launches* the gradient's exchange) is followed by the own half created
between the two, and only then by the matching `_Launch` backward (created before that half),
which waits: the results' gradient travels while the second half's backward runs, the received
rows' gradient while the first half's does. So both all-to-alls of a layer overlap own expert
work, in both directions, on any backend whose collectives run asynchronously (gloo's worker
threads, NCCL's stream); the values are the plain exchange's (the same rows meet the same
weights; only the grouping of the GEMMs differs).

Every other part of the graph is ordinary autograd (the expert GEMMs, the gathers, the combine
all-to-all), so ZeRO-3's parameter hooks, activation checkpointing and saved-tensor offload see
what they see on the plain path. Under ``torch.compile`` the layer keeps the plain exchange.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from deepshard.comm import CommHandle, all_to_all_single

__all__ = ["ExpertRunner", "overlapped_exchange"]

ExpertRunner = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""Runs ``[M, H]`` rows laid out as (source, local expert) blocks with a ``[sources, E/ep]``
count table through this rank's experts; returns ``[M, H]`` outputs in the same order."""


class _InFlight:
    """One all-to-all between its `_Launch` and its `_Land`, forward and backward: rows go
    out with ``send`` splits and come in with ``recv`` ones (their gradient the other way)."""

    def __init__(self, pg: dist.ProcessGroup, send: list[int], recv: list[int]) -> None:
        self.pg, self.send, self.recv = pg, send, recv
        self.forward: CommHandle[torch.Tensor] | None = None
        self.backward: CommHandle[torch.Tensor] | None = None


def _start(
    rows: torch.Tensor, flight: _InFlight, out_splits: list[int], in_splits: list[int]
) -> tuple[CommHandle[torch.Tensor], torch.Tensor]:
    """Launch one all-to-all; returns its handle and the buffer it fills."""
    output = rows.new_empty((sum(out_splits), *rows.shape[1:]))
    handle = all_to_all_single(
        rows.contiguous(),
        group=flight.pg,
        output=output,
        output_split_sizes=out_splits,
        input_split_sizes=in_splits,
        async_op=True,
    )
    return handle, output


class _Launch(torch.autograd.Function):
    """Forward: start sending the remote rows (the output fills in later: read it after
    `_Land`). Backward: wait for the gradient `_Land`'s backward sent back."""

    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor, flight: _InFlight) -> torch.Tensor:
        ctx.flight = flight
        flight.forward, received = _start(rows, flight, flight.recv, flight.send)
        return received

    @staticmethod
    def backward(ctx: Any, _unused: torch.Tensor) -> tuple[torch.Tensor, None]:
        flight: _InFlight = ctx.flight
        assert flight.backward is not None, "_Land's backward launches the return first"
        grad = flight.backward.wait()
        flight.backward = None
        return grad, None


class _Land(torch.autograd.Function):
    """Forward: wait for the remote rows. Backward: start sending their gradient back."""

    @staticmethod
    def forward(ctx: Any, received: torch.Tensor, flight: _InFlight) -> torch.Tensor:
        ctx.flight = flight
        assert flight.forward is not None
        flight.forward.wait()
        flight.forward = None
        return received.view_as(received)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        flight: _InFlight = ctx.flight
        flight.backward, _ = _start(grad, flight, flight.send, flight.recv)
        # `_Launch`'s backward ignores this value and returns what the exchange brings.
        return grad, None


def overlapped_exchange(
    rows: torch.Tensor,
    counts: torch.Tensor,
    table: torch.Tensor,
    *,
    group: dist.ProcessGroup,
    run: ExpertRunner,
) -> torch.Tensor:
    """Dispatch, run the experts and combine, overlapping the own rows with the exchange.

    Args:
        rows: ``[N, H]`` rows sorted by global expert id.
        counts: ``[E]`` int64 rows per global expert from this rank (``sum == N``).
        table: ``[ep, E/ep]`` rows each group rank sends to this rank's experts (the count
            exchange's result; row ``me`` is this rank's own slice).
        group: The ``ep`` process group (``ep > 1``).
        run: Runs rows through this rank's experts (`ExpertRunner`).

    Returns:
        ``[N, H]`` expert outputs in the order of ``rows``.
    """
    ep, me = group.size(), group.rank()
    per_destination = counts.reshape(ep, -1).sum(dim=1)
    host = [int(n) for n in torch.cat([per_destination, table.sum(dim=1)]).tolist()]
    send, recv = host[:ep], host[ep:]
    lo = sum(send[:me])
    hi = lo + send[me]
    send[me] = recv[me] = 0
    if hi == rows.shape[0] or lo == 0:  # the remote rows are one slice: no copy
        remote = rows[:lo] if hi == rows.shape[0] else rows[hi:]
    else:
        remote = torch.cat([rows[:lo], rows[hi:]])
    # The own rows in two halves (split inside an expert if need be): the first runs while
    # the dispatch travels, the second while the results travel back.
    own = table[me]
    first = own.cumsum(dim=0).clamp(max=(hi - lo) // 2).diff(prepend=own.new_zeros(1))
    middle = lo + (hi - lo) // 2
    dispatch = _InFlight(group, send, recv)
    in_flight = _Launch.apply(remote, dispatch)
    own_first = run(rows[lo:middle], first.unsqueeze(0))
    received = _Land.apply(in_flight, dispatch)
    sources = torch.cat([table[:me], table[me + 1 :]])
    done = run(received, sources)
    results = _InFlight(group, recv, send)
    coming_back = _Launch.apply(done, results)
    own_second = run(rows[middle:hi], (own - first).unsqueeze(0))
    back = _Land.apply(coming_back, results)
    before = lo  # rows sent to lower ranks come back first, in rank order
    return torch.cat([back[:before], own_first, own_second, back[before:]])
