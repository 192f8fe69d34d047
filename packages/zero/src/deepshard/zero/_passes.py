"""The backward-pass protocol: which pass ends an accumulation cycle, and when a step may run.

A pass starts when the first parameter of the model receives its gradient (a hook) and ends in
an autograd end-of-pass callback queued at that moment, so a plain ``loss.backward()`` is
enough. Whether the pass is the *boundary* (the last micro-step before the optimizer step) is
said beforehand, in one of three ways, the first that applies winning: inside ``no_sync()`` a
pass never is; ``run(loss, is_boundary=...)`` says it for its own pass; otherwise the standing
flag `boundary` (true until changed) does, which is how an engine that counts micro-steps keeps
plain ``loss.backward()`` calls in step with its accumulation cycle.
After the boundary pass the reduced gradients are *ready*: a step (or ``zero_grad``) must
consume them before the next pass.

A rank on which no parameter got a gradient fires no hook; ``run`` then opens and closes the pass
itself, so the rank still takes part in the collectives the other ranks issue.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator, Sequence

import torch
from torch.autograd import Variable

from deepshard.interface.errors import CommError, ConfigError
from deepshard.zero._full_grad_store import SplitGradients
from deepshard.zero.layout import FlatLayout, ParamSlot

__all__ = ["BackwardPasses", "dense"]


def dense(grad: torch.Tensor) -> torch.Tensor:
    """``grad`` as a strided tensor: ``torch.nn.Embedding(sparse=True)`` produces sparse
    gradients, which go into the flat buckets (and are reduced) like any other; the sparse
    all-gather DeepSpeed's ``sparse_gradients`` uses at stage 0 would only save bandwidth."""
    return grad.to_dense() if grad.layout != torch.strided else grad


class BackwardPasses:
    """Tracks backward passes for a gradient store.

    Args:
        store: Where gradients go and how they are reduced.
        ignore_unused_parameters: ``zero_optimization.ignore_unused_parameters``: when false, a
            pass in which some parameter got no gradient is an error.
    """

    def __init__(self, store: SplitGradients, *, ignore_unused_parameters: bool) -> None:
        self._store = store
        self._ignore_unused = ignore_unused_parameters
        self.boundary = True
        """Whether passes not run through `run` end an accumulation cycle."""
        self._run_boundary: bool | None = None
        self._no_sync_depth = 0
        self._open = False
        self._boundary = False
        self._ready = False
        self._count = 0
        self._closing = False  # the pass is `close_cycle`'s empty one
        self._guard: weakref.WeakMethod[Callable[[str], None]] | None = None

    @property
    def in_pass(self) -> bool:
        """Whether a backward pass is running."""
        return self._open

    @property
    def ready(self) -> bool:
        """Whether a boundary pass has reduced the gradients and no step consumed them yet."""
        return self._ready

    def consume(self) -> None:
        """The step (or ``zero_grad``) used the gradients; passes may start again."""
        self._ready = False

    def close_cycle(self) -> None:
        """End the accumulation cycle with an empty boundary pass: the store reduces what the
        earlier passes accumulated (every bucket is "missing" in this pass). The pass is not
        checked for unused parameters: it has no gradients by design.

        Raises:
            CommError: A backward pass or ``no_sync()`` is running, or the step has not
                consumed the last boundary's gradients.
        """
        self._check_can_close()
        self._run_boundary, self._closing = True, True
        try:
            self._begin()
            self._end()
        finally:
            self._run_boundary, self._closing = None, False

    def mark_ready(self) -> None:
        """End the accumulation cycle without a boundary pass (for stores that reduce every
        pass, whose gradients are complete after any pass).

        Raises:
            CommError: A backward pass or ``no_sync()`` is running.
        """
        self._check_can_close()
        self._ready = True

    def _check_can_close(self) -> None:
        if self._open or self._no_sync_depth:
            where = "a backward pass" if self._open else "no_sync()"
            raise CommError(f"the accumulation cycle cannot end inside {where}")

    def attach(
        self, params: Sequence[Sequence[torch.Tensor]], layouts: Sequence[FlatLayout]
    ) -> list[torch.utils.hooks.RemovableHandle]:
        """Hook every trainable parameter so its gradient goes to the store (and leaves
        ``param.grad``) as soon as autograd has accumulated it.

        Args:
            params: Each group's trainable parameters, in layout order.
            layouts: Their layouts.

        Returns:
            The hook handles (remove them to detach).
        """
        handles = []
        for g, (group, layout) in enumerate(zip(params, layouts, strict=True)):
            for param, slot in zip(group, layout.slots, strict=True):
                hook = self._hook(g, slot)
                handles.append(param.register_post_accumulate_grad_hook(hook))  # type: ignore[no-untyped-call]
        return handles

    def _hook(self, g: int, slot: ParamSlot) -> Callable[[torch.Tensor], None]:
        def hook(param: torch.Tensor) -> None:
            grad, param.grad = param.grad, None
            if grad is not None:
                self.on_gradient(g, slot, dense(grad))

        return hook

    def on_gradient(self, group_index: int, slot: ParamSlot, grad: torch.Tensor) -> None:
        """Hand one parameter's gradient to the store, starting the pass if it is the first."""
        if not self._open:
            self._begin()
            Variable._execution_engine.queue_callback(self._end)
        if slot.numel:
            self._store.add(group_index, slot, grad)

    def run(self, loss: torch.Tensor, *, is_boundary: bool | None, retain_graph: bool) -> None:
        """``loss.backward()`` as a pass with the given boundary flag (``None``: `boundary`)."""
        count = self._count
        self._run_boundary = is_boundary
        try:
            loss.backward(retain_graph=retain_graph)  # type: ignore[no-untyped-call]
            if self._count == count:  # no hook fired on this rank
                self._begin()
                self._end()
        finally:
            self._run_boundary = None

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Passes inside are not boundaries."""
        self._no_sync_depth += 1
        try:
            yield
        finally:
            self._no_sync_depth -= 1

    @property
    def guard(self) -> Callable[[str], None] | None:
        """Called before a pass starts; raises when the pass may not run (states offloaded).

        Held weakly: the parameters' hooks keep these passes alive, and a strong reference to
        the optimizer's method would keep the optimizer (and its NVMe swap files) alive too.
        """
        return None if self._guard is None else self._guard()

    @guard.setter
    def guard(self, method: Callable[[str], None] | None) -> None:
        self._guard = None if method is None else weakref.WeakMethod(method)

    def _begin(self) -> None:
        guard = self.guard
        if guard is not None:
            guard("backward()")
        if self._ready:
            raise CommError(
                "a backward pass followed the accumulation boundary before step(): call step() "
                "(or zero_grad() to drop the gradients) after the boundary's backward"
            )
        declared = self.boundary if self._run_boundary is None else self._run_boundary
        self._boundary = declared and self._no_sync_depth == 0
        self._store.begin(boundary=self._boundary)
        self._open = True
        self._count += 1

    def _end(self) -> None:
        self._open = False
        self._store.finish()
        missing = sum(count for _, count in self._store.missing())
        if missing and not self._ignore_unused and not self._closing:
            raise ConfigError.from_problems(
                [
                    (
                        "zero_optimization.ignore_unused_parameters",
                        f"false, but {missing} parameters got no gradient in this backward pass; "
                        "set it to true (they then count as zero) or exclude them from the "
                        "optimizer",
                    )
                ]
            )
        self._ready = self._boundary
