"""The causal-LM loss of a sequence split over the ``sp`` group.

The loss of a sample is the mean over its valid tokens (labels not ``ignore_index``). Its shards
hold different numbers of valid tokens, so the mean of per-shard means is wrong whenever masked
labels fall unevenly. Each rank instead sums its token losses ``s_r`` and counts its valid
tokens ``n_r``; the loss is ``L = (Σ_r s_r) / (Σ_r n_r)`` on every rank.

The sum over ranks is differentiable (`sum_over_group`: forward and backward both sum over the
group), so rank ``r``'s ``s_r`` receives ``P / N`` from the ``P`` identical copies of ``L``. That
factor ``P`` is what data parallelism takes away again: dense gradients are averaged over
``dp × ep × sp`` (ZeRO's group), which divides the sum of the ``P`` sequence-parallel ranks'
gradients by ``P``. The result is exactly the gradient of ``L`` on the whole sequence, averaged
over the data-parallel replicas as usual; a group with no valid token at all gets a zero loss
(and zero gradient), not NaN.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh

from deepshard.comm import all_reduce
from deepshard.interface.errors import ConfigError

__all__ = ["hf_loss_function", "sp_causal_lm_loss", "sp_mean_loss", "sum_over_group"]


class _SumOverGroup(torch.autograd.Function):
    """All-reduce (sum) forward; all-reduce (sum) of the incoming gradients backward."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: DeviceMesh) -> torch.Tensor:
        ctx.group = group
        out = tensor.clone()
        all_reduce(out, group=group, op="sum")
        return out

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grads[0].contiguous().clone()
        all_reduce(grad, group=ctx.group, op="sum")
        return grad, None


def sum_over_group(tensor: torch.Tensor, *, group: DeviceMesh) -> torch.Tensor:
    """``tensor`` summed over ``group``, differentiably (the backward sums the gradients).

    Args:
        tensor: This rank's contribution (any shape, the same on every rank).
        group: A 1-D mesh (e.g. ``parallel_dims.sp``).

    Returns:
        The sum, the same on every rank.
    """
    if group.size() == 1:
        return tensor
    out: torch.Tensor = _SumOverGroup.apply(tensor, group)
    return out


def sp_mean_loss(
    token_loss_sum: torch.Tensor, valid_tokens: torch.Tensor | int, *, group: DeviceMesh
) -> torch.Tensor:
    """The mean token loss over every rank's shard: ``Σ_r s_r / Σ_r n_r``.

    Use it in a custom training loop: each rank passes the sum of its tokens' losses and how
    many valid tokens its shard has. See the module docstring for why the gradient is right
    once data parallelism averages over ``dp × ep × sp``.

    Args:
        token_loss_sum: ``s_r``, a scalar with a gradient.
        valid_tokens: ``n_r``, this shard's number of valid tokens.
        group: The ``sp`` group.

    Returns:
        The loss of the whole sequence, the same on every rank of ``group``.
    """
    count = torch.as_tensor(valid_tokens, dtype=torch.int64, device=token_loss_sum.device)
    count = count.reshape(()).clone()
    if group.size() > 1:
        all_reduce(count, group=group, op="sum")
    total = sum_over_group(token_loss_sum, group=group)
    return total / count.clamp(min=1).to(total.dtype)


def sp_causal_lm_loss(
    logits: torch.Tensor,
    shift_labels: torch.Tensor,
    *,
    group: DeviceMesh,
    ignore_index: int = -100,
) -> torch.Tensor:
    """The causal-LM cross-entropy of a sequence whose shards live on the ``sp`` ranks.

    Args:
        logits: This shard's logits ``[b, s/P, vocab]``.
        shift_labels: This shard's next-token labels ``[b, s/P]`` (shifted on the *whole*
            sequence before sharding, as `UlyssesDataLoaderAdapter` does).
        group: The ``sp`` group.
        ignore_index: The label of tokens that do not count.

    Returns:
        The mean over every valid token of the whole sequence.

    Raises:
        ConfigError: ``logits`` and ``shift_labels`` do not cover the same tokens.
    """
    if logits.shape[:-1] != shift_labels.shape:
        raise ConfigError(
            f"logits {tuple(logits.shape)} and shift_labels {tuple(shift_labels.shape)} do not "
            "cover the same tokens; shard the batch with UlyssesDataLoaderAdapter"
        )
    labels = shift_labels.reshape(-1).to(logits.device)
    flat = logits.float().reshape(-1, logits.shape[-1])
    token_sum = F.cross_entropy(flat, labels, ignore_index=ignore_index, reduction="sum")
    return sp_mean_loss(token_sum, (labels != ignore_index).sum(), group=group)


def hf_loss_function(
    *, group: DeviceMesh, sharded: Callable[[], bool], fallback: Callable[..., Any]
) -> Callable[..., torch.Tensor]:
    """A Hugging Face ``loss_function`` that reduces over ``group`` while SP is active.

    Args:
        group: The ``sp`` group.
        sharded: Whether the current forward runs on sequence shards (False in eval with
            ``disable_in_eval``: the model's own loss then runs).
        fallback: The model's own loss function.

    Returns:
        ``loss(logits, labels, vocab_size, shift_labels=None, ignore_index=-100, **kwargs)``.
    """

    def loss(
        logits: torch.Tensor,
        labels: torch.Tensor | None,
        vocab_size: int,
        shift_labels: torch.Tensor | None = None,
        ignore_index: int = -100,
        **kwargs: Any,
    ) -> torch.Tensor:
        if not sharded():
            return fallback(  # type: ignore[no-any-return]
                logits,
                labels,
                vocab_size,
                shift_labels=shift_labels,
                ignore_index=ignore_index,
                **kwargs,
            )
        if shift_labels is None:
            raise ConfigError(
                "sequence parallelism needs shift_labels in the batch (labels shifted on the "
                "whole sequence, then sharded): shifting a shard's own labels would lose the "
                "token at every shard boundary; wrap the loader in UlyssesDataLoaderAdapter"
            )
        return sp_causal_lm_loss(logits, shift_labels, group=group, ignore_index=ignore_index)

    return loss
