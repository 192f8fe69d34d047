"""The backward-pass controls of `ZeroOptimizer` (a mixin): which pass ends a cycle, and when.

`backward`, `set_boundary`, `end_accumulation` and `no_sync` hand over to the optimizer's
`deepshard.zero._passes.BackwardPasses`; `deepshard.zero._passes` explains the protocol.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

import torch

from deepshard.zero._full_grad_store import SplitGradients
from deepshard.zero._passes import BackwardPasses

__all__ = ["PassControl"]


class PassControl:
    """`ZeroOptimizer`'s backward-pass controls (a mixin)."""

    _passes: BackwardPasses
    _store: SplitGradients

    if TYPE_CHECKING:

        @property
        def stage(self) -> int:
            """The ZeRO stage (the optimizer's)."""

    def backward(
        self, loss: torch.Tensor, *, is_boundary: bool | None = None, retain_graph: bool = False
    ) -> None:
        """Run ``loss.backward()`` and reduce gradients as the stage requires.

        A plain ``loss.backward()`` works as well (hooks do the work, with the flag of
        `set_boundary`); this method adds a per-pass boundary flag and handles a rank on which
        no parameter got a gradient.

        Args:
            loss: The (already loss-scaled) loss of one micro-batch.
            is_boundary: Whether the optimizer steps after this pass (the last micro-step of a
                gradient-accumulation cycle); ``None`` uses the flag of `set_boundary` (true
                unless changed). Forced false inside `no_sync`.
            retain_graph: Passed to ``backward``.

        Raises:
            CommError: The previous boundary's gradients were not consumed by `step` or
                `zero_grad`.
        """
        self._passes.run(loss, is_boundary=is_boundary, retain_graph=retain_graph)

    def set_boundary(self, flag: bool) -> None:
        """Declare whether the following backward passes end an accumulation cycle.

        The flag stands until changed (it starts true) and applies to every pass, also a plain
        ``loss.backward()``; `backward`'s ``is_boundary`` overrides it for its own pass, and
        `no_sync` forces false. An engine sets it after every micro-step from its counter.

        Args:
            flag: True before the backward of the last micro-step of a cycle, else False.
        """
        self._passes.boundary = bool(flag)

    def end_accumulation(self) -> None:
        """End the accumulation cycle now, after backward passes that were not boundaries.

        For a caller that marks the boundary by stepping rather than before the last backward
        pass (DeepSpeed's ``managed_gradient_accumulation: false``). Stages 0-1, and Muon's
        full groups at every stage, only accumulated locally, so an empty boundary pass reduces
        their buffers (as for a rank whose parameters got no gradient in a boundary pass);
        stage 2's ordinary groups reduce-scattered every pass into their partitions, so when
        they are all there is, the gradients are complete as they are (the store says which:
        ``reduces_every_pass``). Does nothing when a boundary pass already ended the cycle.

        Raises:
            CommError: A backward pass or ``no_sync()`` is running.
        """
        if self._passes.ready:
            return
        if self._store.reduces_every_pass:
            self._passes.mark_ready()
        else:
            self._passes.close_cycle()

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        """Backward passes inside accumulate without ending the accumulation cycle.

        At stages 0-1 they do no communication at all; stage 2 still reduce-scatters each pass
        (it keeps only gradient partitions) but the step stays disallowed until a boundary pass.
        """
        return self._passes.no_sync()
