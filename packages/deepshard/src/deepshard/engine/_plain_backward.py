"""Backward passes a script runs itself: ``loss.backward()`` instead of ``engine.backward(loss)``.

DeepSpeed 0.19.7 lets a script call ``loss.backward()`` (or ``engine.scale(loss).backward()``
under fp16) on the engine's output, and divides the gradients by
``gradient_accumulation_steps`` for it, as ``engine.backward`` divides the loss. It does so by
dividing the gradient arriving at every output tensor of the forward, which divides twice when
one output is computed from another (a Hugging Face model returning ``loss`` computed from its
``logits``: ``1/gas²``). DeepShard divides once, where the gradients are applied:

* every forward registers a hook on its output tensors; the hook does not change the gradient,
  it notes that a backward pass reached the output outside ``engine.backward`` (a *plain* pass)
  and, when a loss scale is in use (fp16), that the loss was scaled with ``engine.scale``
  first: an unscaled plain pass is refused (its gradients would be ``1/scale`` too small), as
  DeepSpeed refuses it;
* at the accumulation boundary, a cycle of plain passes is stepped with the loss scale times
  ``gradient_accumulation_steps``, so ZeRO's unscale divides by both (norm, clipping and
  overflow checks see the mean gradient, exactly as after ``engine.backward``);
* a cycle that mixes both kinds cannot be divided correctly at the boundary and is refused.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from deepshard.interface.errors import ConfigError

__all__ = ["PlainBackward"]


def _output_tensors(output: Any, depth: int = 0) -> Iterator[torch.Tensor]:
    """The tensors with a graph in a forward's output (tensor, tuple/list, dict, ModelOutput)."""
    if isinstance(output, torch.Tensor):
        if output.grad_fn is not None:
            yield output
    elif depth < 4 and isinstance(output, (tuple, list)):
        for item in output:
            yield from _output_tensors(item, depth + 1)
    elif depth < 4 and isinstance(output, Mapping):
        for item in output.values():
            yield from _output_tensors(item, depth + 1)


class PlainBackward:
    """Tracks plain backward passes over one accumulation cycle (see the module docstring).

    Args:
        loss_scale: The engine's current loss scale (1 without fp16 loss scaling).
    """

    def __init__(self, loss_scale: Callable[[], float]) -> None:
        self._loss_scale = loss_scale
        self._in_engine = False
        self._scaled = False
        self._plain = False
        self._engine = False

    def watch(self, output: Any) -> Any:
        """Hooks ``output``'s tensors (a new forward: the loss is not scaled yet); returns it."""
        self._scaled = False
        if torch.is_grad_enabled():
            for tensor in _output_tensors(output):
                tensor.register_hook(self._reached)  # type: ignore[no-untyped-call]
        return output

    def _reached(self, grad: torch.Tensor) -> None:
        if self._in_engine:
            return
        if self._loss_scale() != 1.0 and not self._scaled:
            raise ConfigError(
                "loss.backward() was called on the engine's output without the loss scale "
                "(fp16 loss scaling is on, so the gradients would be too small); call "
                "engine.backward(loss), or engine.scale(loss).backward()"
            )
        self._plain = True

    @contextlib.contextmanager
    def engine_backward(self) -> Iterator[None]:
        """``engine.backward`` is running: its pass divides the loss itself."""
        self._in_engine, self._engine = True, True
        try:
            yield
        finally:
            self._in_engine = False

    def scaled(self) -> None:
        """``engine.scale(loss)`` was called by the script (not by ``engine.backward``)."""
        if not self._in_engine:
            self._scaled = True

    def boundary_factor(self, accumulation_steps: int) -> int:
        """At the boundary: what the loss scale is multiplied by for this cycle's gradients
        (``accumulation_steps`` after plain passes, else 1); starts the next cycle.

        Raises:
            ConfigError: The cycle mixed ``engine.backward`` and plain passes.
        """
        plain, engine = self._plain, self._engine
        self._plain = self._engine = False
        if plain and engine:
            raise ConfigError(
                "one accumulation cycle mixed engine.backward(loss) with loss.backward() on the "
                "engine's output; their gradients carry different scales (engine.backward "
                "divides by gradient_accumulation_steps), so use one of them for a whole cycle"
            )
        return accumulation_steps if plain else 1
