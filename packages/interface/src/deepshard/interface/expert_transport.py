"""The token exchange of expert parallelism, as a protocol every transport implements.

An expert-parallel layer spreads the ``E`` experts of a mixture-of-experts block over the ``ep``
ranks of a group, ``E / ep`` consecutive experts each. After routing, every rank holds its
tokens' ``[T·K]`` (token, choice) rows sorted so that the rows for global expert ``0`` come
first, then expert ``1``..., with ``counts[e]`` rows for expert ``e``. The exchange has two
halves:

* `ExpertTransport.dispatch` sends each row to the rank owning its expert and returns what this
  rank received, grouped by source rank (ascending) and, inside each source, by local expert,
  with a ``[ep, E / ep]`` table of how many rows came from which source for which local expert;
* `ExpertTransport.combine` sends the expert outputs (same row order as received) back to
  where they came from, so the caller gets them in its own sorted order again.

Both halves are differentiable: the gradient of a dispatch is a combine of the gradient, and
the reverse. Implementations: ``deepshard.autoep``'s default over ``deepshard.comm``'s autograd
all-to-all; another library (DeepEP) can be plugged in behind the same two calls. The types are
``Any`` here so that this module stays free of torch (tensors in practice).
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

__all__ = ["ExpertTransport"]


@runtime_checkable
class ExpertTransport(Protocol):
    """Moves expert-sorted token rows to their experts' ranks and back."""

    @property
    def ep_size(self) -> int:
        """Ranks the experts are spread over."""
        ...

    def dispatch(self, rows: Any, counts: Any) -> tuple[Any, Any, Any]:
        """Send rows to the ranks that own their experts.

        Args:
            rows: ``[N, H]`` rows sorted by global expert id.
            counts: ``[E]`` int64 rows per global expert (``sum == N``).

        Returns:
            ``(received, received_counts, plan)``: the ``[M, H]`` rows received, grouped by
            source rank then local expert; the ``[ep, E / ep]`` int64 table of their counts;
            and an opaque plan that `combine` takes to send results back.
        """
        ...

    def combine(self, rows: Any, plan: Any) -> Any:
        """Send ``[M, H]`` results (in the received order) back; returns ``[N, H]`` rows."""
        ...
