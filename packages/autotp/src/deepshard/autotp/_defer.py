"""Handing the sum of replicated-with-grad-allreduce gradients to a sharded optimizer.

`parallelize` sums the gradients of replicated parameters that act on this rank's share of the
activations (Qwen3's ``q_norm``/``k_norm``) over TP with one all-reduce at the end of every
backward pass, into ``.grad`` (`deepshard.autotp._grad_sync`). Under ZeRO that is too late and
in the wrong place: ZeRO takes each gradient out of ``.grad`` as soon as it is accumulated, so
the sum would land in a ``.grad`` nobody reads and leak into the next pass. ZeRO instead sums
such parameters itself, over the axes their placement names in ``sum_over``, once per step on
its reduced partitions (`deepshard.zero._tp`). `defer_grad_allreduce` switches one model from
the first way to the second: it marks those placements and drops the model's reducer (its
hooks hold it only weakly, so they become no-ops).
"""

from __future__ import annotations

from dataclasses import replace

from torch import nn

from deepshard.autotp._parallelize import STATE_ATTRIBUTE, tp_state

__all__ = ["defer_grad_allreduce"]


def defer_grad_allreduce(model: nn.Module) -> tuple[str, ...]:
    """Leave the TP sum of replicated-with-grad-allreduce gradients to the optimizer (ZeRO).

    Args:
        model: A model `parallelize` was applied to.

    Returns:
        The names of the parameters now marked ``sum_over=("tp",)`` in its placements.

    Raises:
        ConfigError: ``model`` was not parallelized.
    """
    state = tp_state(model)
    if state.reducer is None:
        return ()
    names = state.reducer.names
    for name in names:
        state.placements.set(name, replace(state.placements[name], sum_over=("tp",)))
    model.__dict__[STATE_ATTRIBUTE] = replace(state, reducer=None)
    return names
