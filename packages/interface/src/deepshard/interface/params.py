"""Protocols about parameters that a lower package reads and a higher package provides.

An optimizer has to know a parameter's shape as a layer to choose its update rule (Muon is
defined on matrices), but ZeRO-3 stores each parameter as a flat partition whose own ``shape``
is 1-D. The ZeRO package knows the real shape; the optimizers package must not import it. This
module is the meeting point: ZeRO implements `ParamShapes`, the optimizers accept one.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

__all__ = ["ParamShapes"]


@runtime_checkable
class ParamShapes(Protocol):
    """Tells the unpartitioned shape of a parameter that is stored partitioned."""

    def full_shape(self, param: object) -> tuple[int, ...] | None:
        """The parameter's shape as a layer, before partitioning.

        Args:
            param: The parameter tensor as the optimizer holds it (possibly a flat partition).

        Returns:
            The unpartitioned shape, or ``None`` when the parameter is not partitioned (its own
            ``shape`` is then the real one).
        """
        ...
