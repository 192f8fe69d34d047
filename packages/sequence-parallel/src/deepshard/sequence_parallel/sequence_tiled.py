"""`SequenceTiledCompute`: any function of sequence-sharded keyword tensors, tiled.

The generic form of `TiledMLP`: `fn(**sharded_slices, **passed)` runs on `shards` slices along
the sequence dim of every tensor in `sharded` under `no_grad`, the outputs are concatenated
along `output_seq_dim` (or reduced to their mean or sum), and backward recomputes slice by slice
and differentiates with respect to one tensor of `sharded` (`grad_key`) and the parameters.
Slices are `torch.chunk` views along `seq_dim`, so any strides work. Parameter gradients reach
autograd once, after the last slice (see `_tiling`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch

from deepshard.interface.errors import ConfigError
from deepshard.sequence_parallel._tiling import (
    ShardGrads,
    check_shards,
    shard_gradients,
    trainable,
)

__all__ = ["SequenceTiledCompute", "sequence_tiled_compute"]

Reduction = Literal["mean", "sum"] | None


@dataclass(frozen=True)
class _Call:
    """Everything of one tiled call that is not a tensor autograd tracks."""

    fn: Callable[..., torch.Tensor]
    """The function of the keyword slices."""

    shards: int
    """Number of slices."""

    grad_key: str
    """The key of `sharded` whose gradient is returned."""

    other_keys: tuple[str, ...]
    """The other keys of `sharded`, in the order their tensors follow the grad tensor."""

    passed: Mapping[str, Any]
    """Keyword arguments passed to every call unchanged."""

    seq_dim: int
    """The sequence dim of the sharded tensors."""

    output_seq_dim: int
    """The dim the slices' outputs are concatenated along."""

    reduction: Reduction
    """`None` (return the concatenation), `"mean"` or `"sum"` of it."""

    def call(self, grad_slice: torch.Tensor, others: list[torch.Tensor]) -> torch.Tensor:
        kwargs = dict(zip(self.other_keys, others, strict=True))
        return self.fn(**{self.grad_key: grad_slice}, **kwargs, **self.passed)


class _Function(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, call: _Call, n_others: int, x: torch.Tensor, *rest: torch.Tensor
    ) -> torch.Tensor:
        others, params = list(rest[:n_others]), rest[n_others:]
        x_slices = x.chunk(call.shards, dim=call.seq_dim)
        other_slices = [t.chunk(call.shards, dim=call.seq_dim) for t in others]
        outs = [call.call(xs, [o[i] for o in other_slices]) for i, xs in enumerate(x_slices)]
        full = torch.cat(outs, dim=call.output_seq_dim)
        ctx.call, ctx.params = call, params
        ctx.shapes = [p.shape for p in params]
        ctx.sizes = [o.shape[call.output_seq_dim] for o in outs]
        ctx.numel = full.numel()
        ctx.save_for_backward(x, *others)
        if call.reduction is None:
            return full
        return full.mean() if call.reduction == "mean" else full.sum()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        call: _Call = ctx.call
        x, *others = ctx.saved_tensors
        need_x = bool(ctx.needs_input_grad[2])
        if call.reduction is None:
            grads = list(torch.split(grad, ctx.sizes, dim=call.output_seq_dim))
        else:
            scale = grad / ctx.numel if call.reduction == "mean" else grad
            grads = [scale] * len(ctx.sizes)
        other_slices = [t.chunk(call.shards, dim=call.seq_dim) for t in others]
        acc, x_grads = ShardGrads(ctx.shapes, "SequenceTiledCompute"), []
        for i, xs in enumerate(x.chunk(call.shards, dim=call.seq_dim)):
            slice_others = [o[i] for o in other_slices]
            out_grad = grads[i]
            _, x_grad, param_grads = shard_gradients(
                functools.partial(call.call, others=slice_others),
                xs,
                out_grad,
                ctx.params,
                need_x_grad=need_x,
                check_leaves=i == 0,
                what="SequenceTiledCompute",
            )
            acc.add(param_grads)
            x_grads.append(x_grad if x_grad is not None else torch.zeros_like(xs))
        x_grad_full = torch.cat(x_grads, dim=call.seq_dim) if need_x else None
        return (None, None, x_grad_full, *([None] * len(others)), *acc.param_grads)


def _check_call(
    shards: int,
    sharded: Mapping[str, torch.Tensor],
    grad_key: str,
    seq_dim: int,
    output_reduction: Reduction,
) -> None:
    check_shards(shards, "SequenceTiledCompute")
    if grad_key not in sharded:
        raise ConfigError(
            f"SequenceTiledCompute: grad_key {grad_key!r} is not a key of sharded "
            f"({sorted(sharded)})."
        )
    if output_reduction not in (None, "mean", "sum"):
        raise ConfigError(
            "SequenceTiledCompute: output_reduction must be None, 'mean' or 'sum', got "
            f"{output_reduction!r}."
        )
    lengths = {k: t.shape[seq_dim] for k, t in sharded.items()}
    if len(set(lengths.values())) != 1:
        raise ConfigError(
            f"SequenceTiledCompute: every sharded tensor needs the same length in dim "
            f"{seq_dim}, got {lengths}."
        )


def sequence_tiled_compute(
    fn: Callable[..., torch.Tensor],
    shards: int,
    sharded: Mapping[str, torch.Tensor],
    grad_key: str,
    *,
    passed: Mapping[str, Any] | None = None,
    module: object = None,
    compute_params: list[torch.Tensor] | None = None,
    seq_dim: int = 1,
    output_seq_dim: int = 1,
    output_reduction: Reduction = None,
) -> torch.Tensor:
    """`fn(**sharded, **passed)` computed `shards` slices of the sequence at a time.

    Args:
        fn: Called with one slice of every `sharded` tensor and the `passed` values.
        shards: Number of slices along `seq_dim`.
        sharded: Tensors sliced along `seq_dim` (all with the same length there).
        grad_key: The key of `sharded` whose gradient flows back (e.g. `"hidden_states"`).
        passed: Keyword arguments passed unchanged to every call.
        module: Its trainable parameters get their gradients through the op.
        compute_params: The parameters `fn` uses, if not `module.parameters()`.
        seq_dim: The sequence dim of the `sharded` tensors.
        output_seq_dim: The dim along which `fn`'s outputs are concatenated.
        output_reduction: `None` for the concatenated output, or its `"mean"` / `"sum"`.

    Returns:
        The concatenated (or reduced) output, equal to the untiled `fn` for row-wise `fn`.

    Raises:
        ConfigError: On bad `shards`, an unknown `grad_key` or reduction, or sharded tensors
            of different sequence lengths.
    """
    _check_call(shards, sharded, grad_key, seq_dim, output_reduction)
    others = tuple(k for k in sharded if k != grad_key)
    call = _Call(
        fn, shards, grad_key, others, dict(passed or {}), seq_dim, output_seq_dim, output_reduction
    )
    params = trainable(module, compute_params, "SequenceTiledCompute")
    tensors = [sharded[k] for k in others]
    out: torch.Tensor = _Function.apply(call, len(others), sharded[grad_key], *tensors, *params)
    return out


class SequenceTiledCompute:
    """`SequenceTiledCompute.apply(...)`: the same as `sequence_tiled_compute(...)`."""

    apply = staticmethod(sequence_tiled_compute)
