"""Reading and creating parameters of a model that is partitioned already (built under ``Init``).

A model built under ``deepshard.zero.Init`` holds on each rank only its slice of every
parameter: ``param.data`` is empty and the full values exist nowhere. A transformation that
replaces parameters (AutoEP builds each MoE block's local expert stacks from its full experts)
must therefore ask the owner of the partitions for three things, which this protocol names so
that the transforming package needs no import of the ZeRO package (the engine, above both,
joins them):

* `PartitionedParams.full_shape`: a parameter's full shape (its ``.shape`` is ``(0,)``);
* `PartitionedParams.gathered`: a context in which the given parameters are whole (a
  collective: every rank of the group enters with the same parameters), released on exit;
* `PartitionedParams.partition`: parameters just created whole are cut to this rank's slice at
  once, so that at most one block's new parameters are whole at a time.

The types are ``Any`` here so that this module stays free of torch (parameters in practice).
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol, runtime_checkable

__all__ = ["PartitionedParams"]


@runtime_checkable
class PartitionedParams(Protocol):
    """Access to the parameters of an already partitioned model, for a transformation."""

    def full_shape(self, param: Any) -> tuple[int, ...]:
        """The full shape of ``param`` (partitioned or not)."""
        ...

    def gathered(self, params: Sequence[Any]) -> AbstractContextManager[Any]:
        """A block inside which ``params`` are whole; their gathered copies go on exit."""
        ...

    def partition(self, params: Sequence[Any], *, expert: bool) -> None:
        """Cut the whole, newly created ``params`` to this rank's slice now.

        Args:
            params: Parameters created by the transformation (not partitioned yet).
            expert: They are expert parameters, partitioned over the expert data-parallel
                group (``dp``) rather than the dense one.
        """
        ...
