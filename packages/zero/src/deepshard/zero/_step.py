"""The arithmetic of one step on this rank's gradient partitions: overflow, norm, transform, apply.

Without a full-gradient transform the global norm and the overflow flag travel in one all-reduce
(`deepshard.zero.norms`). With one, the overflow of the *raw* gradients is settled first (one
scalar all-reduce), so a step the loss scaler will skip never reaches the transform and its
state (Muon's momentum) stays exactly as it was; only then are the updates computed and the norm
taken, as DeepSpeed takes it, over what the inner optimizer will apply: the transformed updates
and the other gradients. Clipping scales both alike.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from deepshard.comm import CommsLogger, Group
from deepshard.zero._tp import TensorParallelGrads
from deepshard.zero.norms import global_grad_norm, grad_overflow

__all__ = ["NormSettings", "StepResult", "checked_norm", "norm_and_overflow", "step_inner"]


@dataclass(frozen=True)
class StepResult:
    """What `ZeroOptimizer.step` did.

    Attributes:
        overflow: A gradient was not finite on some rank, so the step was skipped (the
            engine's loss scaler should back off).
        grad_norm: Global norm of the unscaled gradients (transformed ones as updates) before
            clipping; ``None`` when ``compute_grad_norm`` is false; not finite on overflow.
    """

    overflow: bool
    grad_norm: float | None


@dataclass(frozen=True)
class NormSettings:
    """How the norm and the overflow flag are computed.

    Attributes:
        compute: ``compute_grad_norm`` (else only the overflow flag).
        norm_type: The norm's order.
        group: The group to all-reduce over; ``None`` when every rank holds everything.
        device: Where the collective runs when this rank holds no gradient.
        logger: Records the collectives.
        tp: Under tensor parallelism, which gradients are replicated over ``tp`` or partial
            sums there (`deepshard.zero._tp`); ``None`` without it.
    """

    compute: bool
    norm_type: float
    group: Group | None
    device: torch.device
    logger: CommsLogger | None
    tp: TensorParallelGrads | None = None

    def overflow(self, grads: Sequence[torch.Tensor]) -> bool:
        """Whether any rank (of the group and of ``tp``) holds a non-finite gradient."""
        tp_group = None if self.tp is None else self.tp.group
        return grad_overflow(
            grads, group=self.group, device=self.device, logger=self.logger, tp_group=tp_group
        )


def norm_and_overflow(
    grads: Sequence[torch.Tensor], loss_scale: float, settings: NormSettings
) -> tuple[float | None, bool]:
    """The unscaled global norm (or ``None``) and the overflow flag, in one collective."""
    s = settings
    if not s.compute:
        return None, s.overflow(grads)
    sliced: Sequence[torch.Tensor] = grads
    replicated: Sequence[torch.Tensor] = ()
    if s.tp is not None:  # tensor-parallel slices and replicas are counted apart
        sliced, replicated = s.tp.split(grads)
    result = global_grad_norm(
        sliced,
        norm_type=s.norm_type,
        group=s.group,
        device=s.device,
        logger=s.logger,
        replicated=replicated,
        tp_group=None if s.tp is None else s.tp.group,
    )
    return result.norm / loss_scale, result.overflow


def checked_norm(
    grads: Sequence[torch.Tensor],
    loss_scale: float,
    settings: NormSettings,
    transform: Callable[[], None] | None,
) -> tuple[float | None, bool]:
    """Check the raw gradients, then run ``transform`` (which rewrites ``grads``) and take the norm.

    Returns:
        As `norm_and_overflow` (which it is without a transform); with one, on overflow the norm
        is ``inf`` (``None`` without a norm) and ``transform`` did not run. Under tensor
        parallelism the partial gradients are summed over ``tp`` first.
    """
    s = settings
    if s.tp is not None:
        s.tp.sum_partials(grads, s.logger)
    if transform is None:
        return norm_and_overflow(grads, loss_scale, settings)
    if s.overflow(grads):
        return (math.inf if s.compute else None), True
    transform()
    if not s.compute:
        return None, False
    return norm_and_overflow(grads, loss_scale, settings)


def step_inner(
    inner: torch.optim.Optimizer,
    views: Sequence[Sequence[tuple[torch.Tensor, int, int]]],
    grads: Sequence[torch.Tensor],
    factor: float,
) -> None:
    """Scale the gradients by ``factor``, hand them to the inner optimizer's tensors, step.

    Args:
        inner: The inner optimizer.
        views: Per group, the tensors it steps and their ``[lo, hi)`` range of the partition.
        grads: This rank's fp32 gradient partitions.
        factor: Unscaling and clipping in one factor.
    """
    for group_views, grad in zip(views, grads, strict=True):
        if factor != 1.0:
            grad.mul_(factor)
        for view, lo, hi in group_views:
            view.grad = grad[lo:hi]
    inner.step()
    for group_views in views:
        for view, _, _ in group_views:
            view.grad = None
