"""Protocols about parameters that a lower package reads and a higher package provides.

An optimizer has to know a parameter's shape as a layer to choose its update rule (Muon is
defined on matrices), but ZeRO-3 stores each parameter as a flat partition whose own ``shape``
is 1-D. The ZeRO package knows the real shape; the optimizers package must not import it. This
module is the meeting point: ZeRO implements `ParamShapes`, the optimizers accept one.

`FullGradientPath` is what ZeRO asks of a path that needs a parameter's *whole* reduced gradient
(Muon's Newton–Schulz) when everything else is element-wise on partitions. Each ZeRO stage family
provides one implementation (stages 0-2 and stage 3 reduce differently), and the optimizer's step
only talks to it through this protocol. Tensors are typed ``Any`` here: this package has no torch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

__all__ = ["FullGradientPath", "ParamShapes"]


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


@runtime_checkable
class FullGradientPath(ParamShapes, Protocol):
    """The whole-gradient path of one ZeRO optimizer on one rank (e.g. Muon's ``use_muon`` groups).

    It owns whole param groups of the inner optimizer: their gradients reach it fully reduced
    (however the stage reduces them), it turns each parameter's full gradient into an update with
    a persistent per-parameter buffer, and writes this rank's pieces of the updates into the
    gradient partitions the inner optimizer then steps element-wise. ``full_shape`` (from
    `ParamShapes`) gives the layer shape of the views it hands the inner optimizer.
    """

    @property
    def groups(self) -> tuple[int, ...]:
        """Indices of the inner optimizer's param groups this path owns (empty: inactive)."""
        ...

    @property
    def active(self) -> bool:
        """Whether any parameter goes through this path (then ``apply`` must run every step)."""
        ...

    def apply(
        self, grads: Sequence[Any], loss_scale: float, param_groups: Sequence[Mapping[str, Any]]
    ) -> None:
        """Replace this rank's pieces of the owned gradients by their updates, in place.

        Called at the step after the overflow check passed and before the norm; the pieces stay
        multiplied by ``loss_scale`` so unscaling and clipping treat them like other gradients.

        Args:
            grads: This rank's fp32 gradient partitions, one per group (stages 0-2) or unit
                (stage 3), laid out like the master partitions.
            loss_scale: The factor the loss was multiplied by.
            param_groups: The inner optimizer's param groups (hyper-parameters as a schedule
                last left them).
        """
        ...

    def tensors(self) -> list[Any]:
        """The live persistent buffers (for ``offload_states``; not copies)."""
        ...

    def nbytes(self) -> int:
        """Bytes of the persistent buffers on this rank (optimizer state)."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """The persistent buffers by parameter name (copies), ZeRO's ``full_grad_buffers``."""
        ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore `state_dict` (raises ``CheckpointError`` for a buffer it does not own)."""
        ...
