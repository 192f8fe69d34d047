"""The shared core of tiled compute: per-shard gradients that reach autograd once.

Tiled compute runs a function on slices of a long activation so that only one slice's
intermediates are alive at a time, and recomputes each slice in backward. Each slice's
backward yields a partial gradient for the parameters the function uses. If those partials
were accumulated into `param.grad` one slice at a time, every gradient hook (ZeRO's
post-accumulate-grad hooks, DDP's reducer) would fire once per slice and reduce an
unfinished gradient. DeepSpeed avoids this by patching a `ds_grad_is_ready` flag onto each
parameter for its own ZeRO only.

Here the parameters are inputs of the tiled autograd Function itself. Each slice's gradients
are computed with `torch.autograd.grad` (which returns them instead of accumulating, so no
parameter hook fires), summed over the slices, and returned from the Function's backward:
autograd then accumulates one final gradient per parameter, exactly as for an untiled op, and
every hook sees it once. A function that uses a parameter that was not passed in would lose
that gradient, so the first slice's graph is checked for leaves that require grad and are not
inputs, and such a call is refused.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import torch

from deepshard.interface.errors import ConfigError

__all__ = ["ShardGrads", "check_shards", "find_unlisted_leaves", "shard_gradients", "trainable"]


def check_shards(shards: object, what: str) -> int:
    """`shards` as a positive int.

    Raises:
        ConfigError: If it is not a positive integer.
    """
    if isinstance(shards, bool) or not isinstance(shards, int) or shards < 1:
        raise ConfigError(f"{what}: shards must be a positive integer, got {shards!r}.")
    return shards


_RELEASED_HINT = (
    "Under ZeRO stage 3, call the tiled op inside the forward of a unit module that owns the "
    "parameters (ZeroPolicy(unit_classes=...)), so that they are whole at that time."
)


def trainable(
    module: object, params: Sequence[torch.Tensor] | None, what: str
) -> list[torch.Tensor]:
    """The parameters whose gradients the tiled op returns: `params`, else the module's.

    Raises:
        ConfigError: If one of them is empty (a released ZeRO-3 parameter: its gradient could
            not be returned in its shape).
    """
    source: Iterable[torch.Tensor] = ()
    if params is not None:
        source = params
    elif isinstance(module, torch.nn.Module):
        source = module.parameters()
    out: list[torch.Tensor] = []
    seen: set[int] = set()
    for p in source:
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    empty = [i for i, p in enumerate(out) if p.numel() == 0]
    if empty:
        raise ConfigError(
            f"{what}: trainable parameters {empty} (in module.parameters() order, or of "
            f"compute_params) are empty when the op is called. {_RELEASED_HINT}"
        )
    return out


def find_unlisted_leaves(
    output: torch.Tensor, allowed: Sequence[torch.Tensor]
) -> list[torch.Tensor]:
    """Leaves that require grad in `output`'s graph and are not in `allowed`."""
    allowed_ids = {id(t) for t in allowed}
    found, seen = [], set()
    stack = [output.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)  # AccumulateGrad nodes hold their leaf
        if isinstance(variable, torch.Tensor) and id(variable) not in allowed_ids:
            found.append(variable)
        stack.extend(next_fn for next_fn, _ in node.next_functions)
    return found


class ShardGrads:
    """The parameters' gradients summed over all shards, checked against their shapes."""

    def __init__(self, shapes: Sequence[torch.Size], what: str) -> None:
        self.shapes = list(shapes)
        self.what = what
        self.param_grads: list[torch.Tensor | None] = [None] * len(self.shapes)

    def add(self, grads: Sequence[torch.Tensor | None]) -> None:
        """Add one shard's parameter gradients (`None` for a parameter it did not use).

        Raises:
            ConfigError: If a gradient's shape is not the parameter's shape when the op was
                called (a ZeRO-3 parameter that was released then and gathered later).
        """
        for i, g in enumerate(grads):
            if g is not None and g.shape != self.shapes[i]:
                raise ConfigError(
                    f"{self.what}: a parameter had shape {tuple(self.shapes[i])} when the op "
                    f"was called but its gradient has shape {tuple(g.shape)}. {_RELEASED_HINT}"
                )
            if g is not None:
                prev = self.param_grads[i]
                self.param_grads[i] = g if prev is None else prev + g


def shard_gradients(
    compute: Callable[[torch.Tensor], torch.Tensor],
    x_shard: torch.Tensor,
    grad_output: torch.Tensor | None,
    params: Sequence[torch.Tensor],
    *,
    need_x_grad: bool,
    check_leaves: bool,
    what: str,
) -> tuple[torch.Tensor, torch.Tensor | None, list[torch.Tensor | None]]:
    """Run `compute` on one shard with grad enabled and differentiate it, accumulating nothing.

    Args:
        compute: The shard's function of its (detached) input rows.
        x_shard: The shard's input rows, detached from the caller's graph.
        grad_output: Upstream gradient of the shard's output (a 0-d one is broadcast); `None`
            for a scalar output (gradient 1).
        params: The parameters to differentiate (the tiled op's inputs).
        need_x_grad: Whether the input's gradient is wanted.
        check_leaves: Refuse leaves that require grad and are not in `params` (first shard).
        what: The calling op's name, for the error.

    Returns:
        The shard's output (detached), the input gradient (or `None`), and one gradient (or
        `None`) per parameter.

    Raises:
        ConfigError: If `check_leaves` finds a parameter the op was not given.
    """
    x = x_shard.detach().requires_grad_(need_x_grad)
    with torch.enable_grad():
        out = compute(x)
    if check_leaves:
        unlisted = find_unlisted_leaves(out, [x, *params])
        if unlisted:
            shapes = [tuple(t.shape) for t in unlisted]
            raise ConfigError(
                f"{what}: fn uses tensors that require grad and are not parameters of the "
                f"module passed in (shapes {shapes}); pass them in compute_params so that "
                "their gradients are returned."
            )
    inputs = ([x] if need_x_grad else []) + list(params)
    if not inputs or not out.requires_grad:
        return out.detach(), None, [None] * len(params)
    if grad_output is not None and grad_output.dim() == 0 and out.dim() > 0:
        grad_output = grad_output.expand_as(out)  # a reduced output's gradient, per element
    grads = torch.autograd.grad(out, inputs, grad_output, allow_unused=True)
    x_grad = grads[0] if need_x_grad else None
    return out.detach(), x_grad, list(grads[1:] if need_x_grad else grads)
