"""How one bucket of gradients is combined over the data-parallel group.

DeepSpeed's top-level keys decide the arithmetic, and DeepShard applies them the same way at
every stage (DeepSpeed itself refuses some combinations at stages 1-2; here they all work):

* ``gradient_allreduce_op: "sum"``: the gradients are summed, nothing is divided.
* ``"mean"`` (the default) with ``prescale_gradients: false``: each rank divides by
  ``gradient_predivide_factor`` *before* the sum and the result is multiplied by
  ``factor / world_size`` *after* it (each step skipped when it is a multiplication by 1), so
  the result is the mean while a large factor keeps fp16 partial sums from overflowing.
* ``"mean"`` with ``prescale_gradients: true``: each rank divides by ``world_size`` before the
  sum.
* ``communication_data_type``: the bucket is cast to this dtype, scaled and reduced in it, then
  written back into the gradient storage (``None``: reduce in the gradients' own dtype).

A reduction is a function of (tensors, group) returning a `PendingReduction`; its ``wait()``
finishes the collective and applies the post-scaling. Over a group of one rank nothing is
combined (the factors before and after multiply to 1), so no collective is issued and the bucket
is its own result.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from deepshard.comm import (
    CommHandle,
    CommsLogger,
    Group,
    all_reduce,
    reduce_scatter_tensor,
    resolve_group,
)
from deepshard.interface.errors import ConfigError

__all__ = ["GradientReduction", "PendingReduction", "reduce_bucket", "torch_dtype"]

_TORCH_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def torch_dtype(name: str | None, *, key: str) -> torch.dtype | None:
    """The torch dtype of a config dtype name (``None`` for ``None``); the one such map.

    Raises:
        ConfigError: An unknown name; the message names ``key``, the config key it came from.
    """
    if name is None:
        return None
    if name not in _TORCH_DTYPES:
        raise ConfigError(f"{key}: must be one of {sorted(_TORCH_DTYPES)}, got {name!r}")
    return _TORCH_DTYPES[name]


@dataclass(frozen=True)
class GradientReduction:
    """The gradient-combining settings of a DeepSpeed config's top level.

    Attributes:
        op: ``gradient_allreduce_op``: ``"mean"`` or ``"sum"`` over the data-parallel ranks.
        prescale: ``prescale_gradients``: divide by the world size before reducing.
        predivide_factor: ``gradient_predivide_factor``: with ``prescale`` off, divide by this
            before and multiply by ``factor / world_size`` after the reduction.
        dtype: ``communication_data_type``: reduce in this dtype; ``None`` reduces in the
            gradients' own dtype.
    """

    op: Literal["mean", "sum"] = "mean"
    prescale: bool = False
    predivide_factor: float = 1.0
    dtype: torch.dtype | None = None

    def __post_init__(self) -> None:
        if self.op not in ("mean", "sum"):
            raise ConfigError(f'gradient_allreduce_op: must be "mean" or "sum", got {self.op!r}')
        if not self.predivide_factor > 0:
            raise ConfigError(
                f"gradient_predivide_factor: must be > 0, got {self.predivide_factor}"
            )

    @classmethod
    def from_names(
        cls,
        *,
        op: Literal["mean", "sum"] = "mean",
        prescale: bool = False,
        predivide_factor: float = 1.0,
        dtype: str | None = None,
    ) -> GradientReduction:
        """Builds the settings from config values (``dtype`` as ``"fp32"``, ``"bf16"``...)."""
        comm_dtype = torch_dtype(dtype, key="communication_data_type")
        return cls(op, prescale, predivide_factor, comm_dtype)

    def pre_factor(self, world_size: int) -> float:
        """What each rank multiplies its gradients by before the sum."""
        if self.op == "sum":
            return 1.0
        if self.prescale:
            return 1.0 / world_size
        return 1.0 / self.predivide_factor

    def post_factor(self, world_size: int) -> float:
        """What the summed gradients are multiplied by after the reduction."""
        if self.op == "sum" or self.prescale or self.predivide_factor == world_size:
            return 1.0
        return self.predivide_factor / world_size

    def comm_dtype(self, grad_dtype: torch.dtype) -> torch.dtype:
        """The dtype a bucket of ``grad_dtype`` gradients is reduced in."""
        return grad_dtype if self.dtype is None else self.dtype


class PendingReduction:
    """A bucket reduction in flight; `wait` returns the (post-scaled) result once."""

    __slots__ = ("_handle", "_post", "_result", "_view")

    def __init__(
        self, handle: CommHandle[torch.Tensor], post: float, view: slice | None = None
    ) -> None:
        self._handle = handle
        self._post = post
        self._view = view
        self._result: torch.Tensor | None = None

    def wait(self) -> torch.Tensor:
        """Finish the collective and return the reduced bucket or this rank's chunk of it."""
        if self._result is None:
            out = self._handle.wait()
            if self._view is not None:
                out = out[self._view]
            if self._post != 1.0:
                out.mul_(self._post)
            self._result = out
        return self._result


def reduce_bucket(
    bucket: torch.Tensor,
    *,
    group: Group,
    reduction: GradientReduction,
    scatter: bool,
    use_reduce_scatter: bool = True,
    output: torch.Tensor | None = None,
    async_op: bool = False,
    logger: CommsLogger | None = None,
) -> PendingReduction:
    """Start reducing one flat bucket of gradients over ``group``.

    Args:
        bucket: The bucket in the communication dtype, 1-D, a multiple of the group size long
            when ``scatter``. It is scaled in place and, for an all-reduce, reduced in place.
        group: The data-parallel group.
        reduction: The arithmetic (see the module docstring).
        scatter: Whether this rank needs only its chunk (rank ``r`` gets the ``r``-th of equal
            parts) instead of the whole reduced bucket.
        use_reduce_scatter: With ``scatter``, use a reduce-scatter (``zero_optimization.
            reduce_scatter``); otherwise all-reduce the bucket and keep the chunk.
        output: Where a reduce-scatter writes the chunk; allocated when ``None``.
        async_op: Return before the collective finishes.
        logger: Records the collective.

    Returns:
        The pending reduction; its ``wait()`` gives the bucket (``scatter`` false) or the
        chunk.
    """
    pg = resolve_group(group)
    size, rank = pg.size(), pg.rank()
    if size == 1:  # nothing to combine; the pre- and post-factors multiply to 1
        return PendingReduction(CommHandle(bucket), 1.0)
    pre = reduction.pre_factor(size)
    if pre != 1.0:
        bucket.mul_(pre)
    post = reduction.post_factor(size)
    if scatter and use_reduce_scatter:
        handle = reduce_scatter_tensor(
            bucket,
            group=pg,
            output=output,
            async_op=async_op,
            logger=logger,
            log_name="zero_reduce_scatter_grads",
        )
        return PendingReduction(handle, post)
    handle = all_reduce(
        bucket, group=pg, async_op=async_op, logger=logger, log_name="zero_all_reduce_grads"
    )
    if not scatter:
        return PendingReduction(handle, post)
    chunk = bucket.numel() // size
    return PendingReduction(handle, post, slice(rank * chunk, (rank + 1) * chunk))
