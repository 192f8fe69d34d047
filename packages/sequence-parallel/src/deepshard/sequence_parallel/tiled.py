"""Tiled MLP and tiled logits-loss: cut the activation peaks of long sequences.

At long sequence lengths the MLP's intermediate (`[b, s, 4h]` or more) and the logits
(`[b, s, vocab]`) dominate activation memory. Both are row-wise in the tokens, so they can be
computed a slice of rows at a time:

* `TiledMLP.apply(fn, module, x, shards)`: the forward runs `fn(module, rows)` on `shards`
  slices of the flattened `[b * s, h]` rows under `no_grad` (no intermediates kept); the
  backward recomputes each slice with grad enabled and differentiates it.
* `TiledFusedLogitsLoss.apply(fn, module, x, y, mask, shards, output_reduction)`: the loss
  is the last op, so its forward computes each slice's loss *and* the slice's input and
  parameter gradients at once (never holding more than one slice of logits); backward only
  scales the stored gradients by the incoming one.

Rows are flattened with `reshape`, not `view`, so transposed or sliced (non-contiguous)
activations work. Parameter gradients reach autograd once, after the last slice (see
`_tiling`), so ZeRO's gradient hooks see one final gradient. With `output_reduction="mean"`,
`fn` returns the mean over its slice's valid tokens (the `mask`'s true entries, or all rows)
and the slices are combined weighted by their valid-token counts: the result is the mean over
all valid tokens, exactly the untiled loss, for any number of slices and any masking (DeepSpeed
averages the slice means, which differs when the slices' counts differ).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Literal

import torch

from deepshard.interface.errors import ConfigError
from deepshard.sequence_parallel._tiling import (
    ShardGrads,
    check_shards,
    shard_gradients,
    trainable,
)

__all__ = ["TiledFusedLogitsLoss", "TiledMLP", "tiled_fused_logits_loss", "tiled_mlp"]

MLPFn = Callable[[Any, torch.Tensor], torch.Tensor]
LossFn = Callable[..., torch.Tensor]


def _rows(t: torch.Tensor, lead: int) -> torch.Tensor:
    return t.reshape(-1, *t.shape[lead:])


class _TiledMLPFunction(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, fn: MLPFn, module: Any, x: torch.Tensor, shards: int, *params: torch.Tensor
    ) -> torch.Tensor:
        rows = _rows(x, x.dim() - 1)
        outs = []
        for chunk in rows.chunk(shards):
            out = fn(module, chunk)
            if out.dim() != 2 or out.shape[0] != chunk.shape[0]:
                raise ConfigError(
                    f"TiledMLP: fn must map each token's row to one output row; rows "
                    f"{tuple(chunk.shape)} gave {tuple(out.shape)}."
                )
            outs.append(out)
        ctx.fn, ctx.module, ctx.shards, ctx.params = fn, module, shards, params
        ctx.shapes = [p.shape for p in params]
        ctx.save_for_backward(x)
        return torch.cat(outs).reshape(*x.shape[:-1], outs[0].shape[-1])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (x,) = ctx.saved_tensors
        need_x = bool(ctx.needs_input_grad[2])
        rows = _rows(x, x.dim() - 1)
        grad_rows = _rows(grad, grad.dim() - 1)
        acc = ShardGrads(ctx.shapes, "TiledMLP")
        x_grads = []
        chunks = zip(rows.chunk(ctx.shards), grad_rows.chunk(ctx.shards), strict=True)
        for i, (chunk, grad_chunk) in enumerate(chunks):
            _, x_grad, param_grads = shard_gradients(
                lambda t: ctx.fn(ctx.module, t),
                chunk,
                grad_chunk,
                ctx.params,
                need_x_grad=need_x,
                check_leaves=i == 0,
                what="TiledMLP",
            )
            acc.add(param_grads)
            x_grads.append(x_grad if x_grad is not None else torch.zeros_like(chunk))
        x_grad_full = torch.cat(x_grads).reshape(x.shape) if need_x else None
        return (None, None, x_grad_full, None, *acc.param_grads)


def tiled_mlp(
    fn: MLPFn,
    module: Any,
    x: torch.Tensor,
    shards: int,
    compute_params: list[torch.Tensor] | None = None,
) -> torch.Tensor:
    """`fn(module, x)` computed `shards` slices of tokens at a time, recomputed in backward.

    Args:
        fn: Row-wise function, e.g. `lambda m, x: m.down_proj(m.act_fn(m.gate_proj(x)) *
            m.up_proj(x))`; called with rows `[n, hidden]`, returns `[n, out]`.
        module: Passed to `fn`; its trainable parameters get their gradients through the op.
        x: `[..., hidden]`, any strides (e.g. `[b, s, h]` or `[s, h]`).
        shards: Number of slices of the flattened rows.
        compute_params: The parameters `fn` uses, if not `module.parameters()`.

    Returns:
        `[..., out]`, equal to `fn(module, x)`.

    Raises:
        ConfigError: On bad `shards`, an `fn` that does not map rows to rows, or (in backward)
            an `fn` that uses a trainable tensor it was not given.
    """
    check_shards(shards, "TiledMLP")
    if x.dim() < 2:
        raise ConfigError(f"TiledMLP: x must be at least 2-D [..., hidden], got {tuple(x.shape)}.")
    params = trainable(module, compute_params, "TiledMLP")
    out: torch.Tensor = _TiledMLPFunction.apply(fn, module, x, shards, *params)
    return out


class _TiledLossFunction(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        fn: LossFn,
        module: Any,
        x: torch.Tensor,
        y: torch.Tensor,
        mask: torch.Tensor | None,
        shards: int,
        reduction: str,
        *params: torch.Tensor,
    ) -> torch.Tensor:
        need_x = bool(ctx.needs_input_grad[2])
        xs, ys = _rows(x, 2).chunk(shards), _rows(y, 2).chunk(shards)
        ms = _rows(mask, 2).bool().chunk(shards) if mask is not None else (None,) * len(xs)
        counts = [
            int(m.sum()) if m is not None else c.shape[0] for m, c in zip(ms, xs, strict=True)
        ]
        total = sum(counts)
        acc = ShardGrads([p.shape for p in params], "TiledFusedLogitsLoss")
        loss = x.new_zeros(())
        x_grads = []
        for i, (xc, yc, mc) in enumerate(zip(xs, ys, ms, strict=True)):
            weight = counts[i] / total if reduction == "mean" and total else 1.0
            if reduction == "mean" and counts[i] == 0:  # its mean is 0/0; it weighs nothing
                x_grads.append(torch.zeros_like(xc))
                continue
            extra = () if mc is None else (mc,)
            out, x_grad, param_grads = shard_gradients(
                functools.partial(_slice_loss, fn, module, yc, extra),
                xc,
                torch.tensor(weight, dtype=x.dtype, device=x.device),
                params,
                need_x_grad=need_x,
                check_leaves=i == 0,
                what="TiledFusedLogitsLoss",
            )
            loss = loss + out * weight
            acc.add(param_grads)
            x_grads.append(x_grad if x_grad is not None else torch.zeros_like(xc))
        ctx.x_grad = torch.cat(x_grads).reshape(x.shape) if need_x else None
        ctx.param_grads = acc.param_grads
        return loss

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x_grad = None if ctx.x_grad is None else ctx.x_grad * grad
        param_grads = [None if g is None else g * grad for g in ctx.param_grads]
        return (None, None, x_grad, None, None, None, None, *param_grads)


def _slice_loss(
    fn: LossFn, module: Any, y: torch.Tensor, extra: tuple[torch.Tensor, ...], x: torch.Tensor
) -> torch.Tensor:
    out = fn(module, x, y, *extra)
    if out.numel() != 1:
        raise ConfigError(
            f"TiledFusedLogitsLoss: fn must return one loss value per slice, got shape "
            f"{tuple(out.shape)}; reduce it (mean over the slice's valid tokens, or sum)."
        )
    return out.reshape(())


def _check_loss_inputs(
    x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor | None, reduction: str
) -> None:
    if reduction not in ("mean", "sum"):
        raise ConfigError(
            f"TiledFusedLogitsLoss: output_reduction must be 'mean' or 'sum', got {reduction!r}."
        )
    if x.dim() < 2 or y.dim() < 2 or x.shape[:2] != y.shape[:2]:
        raise ConfigError(
            f"TiledFusedLogitsLoss: x and y must be at least 2-D with the same [batch, seq] "
            f"dims, got x {tuple(x.shape)} and y {tuple(y.shape)}."
        )
    if mask is not None and mask.shape != x.shape[:2]:
        raise ConfigError(
            f"TiledFusedLogitsLoss: mask must be [batch, seq] = {tuple(x.shape[:2])}, got "
            f"{tuple(mask.shape)}."
        )


def tiled_fused_logits_loss(
    fn: LossFn,
    module: Any,
    x: torch.Tensor,
    y: torch.Tensor,
    mask: torch.Tensor | None,
    shards: int,
    output_reduction: Literal["mean", "sum"] = "mean",
    compute_params: list[torch.Tensor] | None = None,
) -> torch.Tensor:
    """A loss over `[batch, seq]` tokens computed slice by slice, never holding all logits.

    Args:
        fn: `fn(module, x_rows, y_rows)` (plus `mask_rows` when `mask` is given) returns the
            slice's loss: its mean over the valid tokens for `"mean"`, its sum for `"sum"`.
        module: Passed to `fn` (e.g. the model, whose `lm_head` makes the logits).
        x: `[b, s, ...]` hidden states, any strides.
        y: `[b, s, ...]` targets (e.g. shifted labels).
        mask: `[b, s]` valid-token mask (true = counted), or `None` (every token counts).
        shards: Number of slices of the flattened `b * s` rows.
        output_reduction: `"mean"` (over valid tokens) or `"sum"`.
        compute_params: The parameters `fn` uses, if not `module.parameters()`.

    Returns:
        The scalar loss, equal to the untiled loss.

    Raises:
        ConfigError: On a bad reduction, mismatched shapes, bad `shards`, an `fn` that does
            not return one value, or one that uses a trainable tensor it was not given.
    """
    check_shards(shards, "TiledFusedLogitsLoss")
    _check_loss_inputs(x, y, mask, output_reduction)
    params = trainable(module, compute_params, "TiledFusedLogitsLoss")
    out: torch.Tensor = _TiledLossFunction.apply(
        fn, module, x, y, mask, shards, output_reduction, *params
    )
    return out


class TiledMLP:
    """DeepSpeed's name: `TiledMLP.apply(fn, module, x, shards, compute_params=None)`."""

    apply = staticmethod(tiled_mlp)


class TiledFusedLogitsLoss:
    """DeepSpeed's name: `TiledFusedLogitsLoss.apply(fn, module, x, y, mask, shards, ...)`."""

    apply = staticmethod(tiled_fused_logits_loss)
