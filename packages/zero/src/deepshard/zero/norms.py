"""The global gradient norm, the overflow check and the clip factor, with at most one collective.

Each rank holds some gradients (its partitions at stages 1-2, everything at stage 0). The
global ``p``-norm is ``(Σ_ranks Σ_tensors ||g||_p^p)^(1/p)``, and the ``inf``-norm the maximum
of the ranks' maxima, so each rank reduces its tensors to one number and one all-reduce (sum,
resp. max) combines them. A second number travels in the same all-reduce: whether this rank saw
a non-finite value. It is kept apart from the norm itself because a maximum over a NaN is not
reliably NaN on every backend.

**Precision.** A 2-norm (the default) or a 1-norm is taken in two levels: every run of
`NORM_BLOCK` (1024) consecutive elements is reduced in fp32 (``vector_norm`` over the rows of a
``[k, 1024]`` view, no copy for fp32 gradients), and the blocks' ``||·||_p^p`` are accumulated
in fp64 (fp32 on devices without fp64, MPS). So the error is that of one 1024-element fp32
reduction, whatever the gradient's length: at most about ``1024 · 2^-24 ≈ 6e-5`` relative (the
bound for summing 1024 terms in any order), ``1e-11 .. 1e-8`` measured on gradient-like data,
where one fp32 reduction over a whole 2M-element gradient is off by ``3e-7 .. 2e-4``. It is not
the fp64 sum of every element that DeepSpeed takes (it casts each gradient to fp64 first: for
10M elements an 80 MB copy and ~30x the time); it needs no cast at all. Should a block overflow
fp32 although its values are finite (a 2-norm over elements near ``1e18``), the local sum is
recomputed with every element in fp64 before the overflow flag is set. Other orders take every
element in fp64 (torch's fp32 ``|x|^p`` reductions are too coarse for blocks); the ``inf``-norm
is a maximum, exact in any dtype. Gradients are processed `NORM_CHUNK` elements at a time, so
no temporary grows with the model.

When every rank already holds the same, fully reduced gradients (stage 0), no collective is
needed: pass ``group=None``.

**Tensor parallelism.** Ranks of one tensor-parallel group hold different slices of the
sharded parameters but the same values of the replicated ones (a LayerNorm, a row-parallel
bias, a ``q_norm`` once its partial gradients are summed). The vector's norm counts each
element once: the sharded part's ``Σ|g|^p`` is summed over ``tp_group`` too, the replicated
part (``replicated``) is not. Both parts travel in the data-parallel all-reduce, then only the
sharded part and the flag in a second, tiny one over ``tp_group``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from deepshard.comm import CommsLogger, Group, all_reduce
from deepshard.interface.errors import ConfigError

__all__ = [
    "NORM_BLOCK",
    "NORM_CHUNK",
    "GradNorm",
    "check_norm_type",
    "global_grad_norm",
    "grad_overflow",
    "scale_factor",
]

CLIP_EPSILON = 1e-6
"""Added to the norm before dividing, as ``torch.nn.utils.clip_grad_norm_`` and DeepSpeed do."""

NORM_BLOCK = 1024
"""Elements reduced in fp32 before the fp64 sum (see the module docstring)."""

BLOCKED_NORM_TYPES = (1.0, 2.0)
"""Orders taken in fp32 blocks; torch's fp32 reductions for other orders (``|x|^p`` through
``pow``) are too coarse for that, so they take every element in fp64."""

NORM_CHUNK = 1 << 20
"""Most elements of a gradient processed by one operation, bounding every temporary."""


@dataclass(frozen=True)
class GradNorm:
    """The result of `global_grad_norm`.

    Attributes:
        norm: The global norm of the gradients as given (not unscaled); not finite on overflow.
        overflow: Whether any rank held a non-finite gradient value.
    """

    norm: float
    overflow: bool


def check_norm_type(norm_type: float) -> float:
    """Validate a norm order: a positive number or ``inf``.

    Raises:
        ConfigError: Otherwise.
    """
    value = float(norm_type)
    if not value > 0:
        raise ConfigError(f"norm_type must be > 0 or inf, got {norm_type!r}")
    return value


def _norm_dtype(device: torch.device) -> torch.dtype:
    return torch.float32 if device.type == "mps" else torch.float64


def _chunks(tensor: torch.Tensor) -> list[torch.Tensor]:
    flat = tensor.reshape(-1)
    return [flat[lo : lo + NORM_CHUNK] for lo in range(0, flat.numel(), NORM_CHUNK)]


def _block_powers(chunk: torch.Tensor, p: float) -> list[torch.Tensor]:
    """fp32 ``p``-norms of the chunk's consecutive `NORM_BLOCK`-element blocks (1-D)."""
    whole = chunk.numel() // NORM_BLOCK * NORM_BLOCK
    parts = []
    if whole:
        rows = chunk[:whole].view(-1, NORM_BLOCK)
        parts.append(torch.linalg.vector_norm(rows, p, dim=1, dtype=torch.float32))
    if whole < chunk.numel():
        tail = torch.linalg.vector_norm(chunk[whole:], p, dtype=torch.float32)
        parts.append(tail.reshape(1))
    return parts


def _sum_of_powers(tensors: Sequence[torch.Tensor], p: float, dtype: torch.dtype) -> torch.Tensor:
    """``Σ ||t||_p^p``: fp32 within blocks, ``dtype`` across them."""
    blocks = [b for t in tensors for chunk in _chunks(t) for b in _block_powers(chunk, p)]
    return torch.cat(blocks).to(dtype).pow(p).sum()


def _exact_sum_of_powers(
    tensors: Sequence[torch.Tensor], p: float, dtype: torch.dtype
) -> torch.Tensor:
    """``Σ ||t||_p^p`` with every element in ``dtype`` (the path for fp32 overflow)."""
    norms = [torch.linalg.vector_norm(c, p, dtype=dtype) for t in tensors for c in _chunks(t)]
    return torch.stack(norms).pow(p).sum()


def _local_stats(
    tensors: Sequence[torch.Tensor], norm_type: float, device: torch.device
) -> torch.Tensor:
    """``[Σ ||t||_p^p (or max |t|), 1.0 if that is not finite]``, in the norm dtype."""
    dtype = _norm_dtype(device)
    present = [t for t in tensors if t.numel()]
    if not present:
        value = torch.zeros((), dtype=dtype, device=device)
    elif math.isinf(norm_type):
        maxima = [torch.linalg.vector_norm(c, norm_type) for t in present for c in _chunks(t)]
        value = torch.stack(maxima).max().to(dtype)
    elif norm_type in BLOCKED_NORM_TYPES:
        value = _sum_of_powers(present, norm_type, dtype)
        if not bool(torch.isfinite(value)):  # a non-finite value, or an fp32 block overflowed
            value = _exact_sum_of_powers(present, norm_type, dtype)
    else:
        value = _exact_sum_of_powers(present, norm_type, dtype)
    flag = (~torch.isfinite(value)).to(dtype)
    return torch.stack([value, flag])


def global_grad_norm(
    tensors: Sequence[torch.Tensor],
    *,
    norm_type: float = 2.0,
    group: Group | None,
    device: torch.device | None = None,
    logger: CommsLogger | None = None,
    replicated: Sequence[torch.Tensor] = (),
    tp_group: Group | None = None,
) -> GradNorm:
    """The norm of all ranks' ``tensors`` taken as one vector, and whether any is non-finite.

    Args:
        tensors: This rank's gradients (any float dtype; padding must be zero); with
            ``tp_group``, those whose elements differ across it (tensor-parallel slices).
        norm_type: ``p`` of the ``p``-norm, or ``math.inf``.
        group: The ranks whose tensors together form the vector; ``None`` when this rank's
            tensors are already the whole vector (no collective).
        device: Where the collective runs when this rank holds no tensor; the tensors'
            device otherwise.
        logger: Records the all-reduces.
        replicated: Gradients every rank of ``tp_group`` holds alike, counted once.
        tp_group: The tensor-parallel group ``tensors`` are sliced over; ``None``: no tensor
            parallelism (``replicated`` then simply joins ``tensors``).

    Returns:
        The norm and the overflow flag, equal on every rank.
    """
    p = check_norm_type(norm_type)
    op: Literal["max", "sum"] = "max" if math.isinf(p) else "sum"
    where = _device([*tensors, *replicated], device)
    if tp_group is None:
        stats = _local_stats([*tensors, *replicated], p, where)
        if group is not None:
            all_reduce(stats, group=group, op=op, logger=logger, log_name="zero_grad_norm")
        value, flag = stats.tolist()
    else:
        stats = torch.cat([_local_stats(tensors, p, where), _local_stats(replicated, p, where)])
        if group is not None:
            all_reduce(stats, group=group, op=op, logger=logger, log_name="zero_grad_norm")
        sliced = stats[:2].clone()
        all_reduce(sliced, group=tp_group, op=op, logger=logger, log_name="zero_grad_norm_tp")
        sharded, flag = sliced.tolist()
        once, once_flag = stats[2:].tolist()
        value = max(sharded, once) if math.isinf(p) else sharded + once
        flag = max(flag, once_flag)
    norm = value if math.isinf(p) else value ** (1.0 / p)
    return GradNorm(norm=norm, overflow=flag > 0 or not math.isfinite(norm))


def _device(tensors: Sequence[torch.Tensor], device: torch.device | None) -> torch.device:
    if tensors:
        return tensors[0].device
    return device if device is not None else torch.device("cpu")


def grad_overflow(
    tensors: Sequence[torch.Tensor],
    *,
    group: Group | None,
    device: torch.device | None = None,
    logger: CommsLogger | None = None,
    tp_group: Group | None = None,
) -> bool:
    """Whether any rank holds a non-finite value, without computing a norm (one tiny collective).

    Args:
        tensors: This rank's gradients.
        group: As for `global_grad_norm`.
        device: As for `global_grad_norm`.
        logger: Records the all-reduce.
        tp_group: The tensor-parallel group, whose ranks must skip a step together.
    """
    flag = torch.zeros(1, dtype=torch.float32, device=_device(tensors, device))
    for tensor in tensors:
        for chunk in _chunks(tensor):
            flag += (~torch.isfinite(chunk)).any()
    flag.clamp_(max=1.0)
    if group is not None:
        all_reduce(flag, group=group, op="max", logger=logger, log_name="zero_grad_overflow")
    if tp_group is not None:
        all_reduce(flag, group=tp_group, op="max", logger=logger, log_name="zero_grad_overflow")
    return bool(flag.item() > 0)


def scale_factor(norm: float | None, *, clip: float, loss_scale: float) -> float:
    """What to multiply the (loss-scaled) gradients by: unscaling and clipping in one factor.

    Clipping follows ``torch.nn.utils.clip_grad_norm_``: gradients whose norm exceeds ``clip``
    are multiplied by ``clip / (norm + 1e-6)``.

    Args:
        norm: The *unscaled* global norm; ignored when ``clip`` is 0.
        clip: ``gradient_clipping``; 0 disables clipping.
        loss_scale: The factor the loss was multiplied by before backward.

    Returns:
        The factor; exactly 1.0 when there is nothing to do.

    Raises:
        ConfigError: Clipping is on but no norm was computed.
    """
    factor = 1.0 / loss_scale
    if clip > 0:
        if norm is None:
            raise ConfigError(
                "gradient_clipping > 0 needs the gradient norm; set "
                "zero_optimization.compute_grad_norm to true or gradient_clipping to 0"
            )
        coefficient = clip / (norm + CLIP_EPSILON)
        if coefficient < 1.0:
            factor *= coefficient
    return factor
