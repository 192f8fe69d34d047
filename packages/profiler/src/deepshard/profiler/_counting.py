"""Counting aten operators and attributing them to the module tree.

How an operator finds its module:

* **Forward.** A forward pre-hook and a forward hook (``always_call``, so an exception does not
  leave a frame behind) on every module keep the stack of modules whose forward is running.
  A ``TorchDispatchMode`` sees every aten operator, however it was reached (``F.linear``,
  ``x @ w``, ``torch.einsum``, SDPA, a compiled graph run eagerly), and adds its FLOPs to every
  module on the stack, each module object once (a module nested in itself is not counted
  twice). A module called by several parents therefore holds the sum of its calls, and each
  parent only what ran inside its own call.
* **Backward.** Autograd numbers every node it records with a per-thread sequence number. Each
  push or pop of the stack records the next number and the new stack (a "segment"), so the node
  an operator runs for in backward (``torch._C._current_autograd_node()``) maps, by bisection,
  to the stack that was current when its forward recorded it. Nodes recorded outside the model
  (the loss computed by the caller, gradient accumulation into ``.grad``) count nothing, as in
  the forward. Forward hooks firing inside backward (activation recomputation) do not touch the
  stack: that work is the backward's.

Nothing global is modified: the mode is pushed on the thread's mode stack and popped, the
hooks are removed by handle, and no attribute is set on a module or tensor.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.hooks import RemovableHandle

from deepshard.profiler._formulas import Formula, formula_for, op_name

__all__ = ["ModuleTally", "Recorder"]

_UNSEEN = object()


@dataclass
class ModuleTally:
    """What one module object accumulated while profiling (a mutable accumulator)."""

    flops: int = 0
    """Forward FLOPs of every call."""
    macs: int = 0
    """Forward multiply-accumulates of every call."""
    backward_flops: int = 0
    """Backward FLOPs of the nodes its forward recorded (when backward is counted)."""
    backward_macs: int = 0
    """Backward multiply-accumulates."""
    duration_s: float = 0.0
    """Wall-clock seconds of its forward calls (outermost calls only)."""
    calls: int = 0
    """Forward calls."""


@dataclass
class _Frame:
    module_id: int
    start_s: float
    outer_stack: tuple[int, ...]


@dataclass
class _Segments:
    """Autograd sequence numbers at which the module stack changed, and the stack from there."""

    starts: list[int] = field(default_factory=list)
    stacks: list[tuple[int, ...]] = field(default_factory=list)

    def mark(self, stack: tuple[int, ...]) -> None:
        seq = torch._C._autograd._get_sequence_nr()
        if self.starts and self.starts[-1] == seq:
            self.stacks[-1] = stack  # no node was recorded under the previous stack
        else:
            self.starts.append(seq)
            self.stacks.append(stack)

    def stack_of(self, seq: int) -> tuple[int, ...]:
        index = bisect.bisect_right(self.starts, seq) - 1
        return self.stacks[index] if index >= 0 else ()


class Recorder:
    """Counts operators into per-module tallies while its hooks and mode are installed.

    Args:
        model: The model whose modules are tracked.
        ignore_types: Module types whose forward (and backward) is not counted at all.
        count_backward: Also count the backward operators of nodes the model's forward recorded.
        synchronize: Waits for queued device work before each clock reading.
        clock: Monotonic seconds.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        ignore_types: tuple[type, ...],
        count_backward: bool,
        synchronize: Callable[[], None],
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.model = model
        self.count_backward = count_backward
        self.tallies: dict[int, ModuleTally] = {}
        self.ops: dict[str, list[int]] = {}
        self._ignore_types = ignore_types
        self._synchronize = synchronize
        self._clock = clock
        self._stack: tuple[int, ...] = ()
        self._frames: list[_Frame] = []
        self._ignoring = 0
        self._segments = _Segments()
        self._handles: list[RemovableHandle] = []
        self._mode: _CountingMode | None = None

    # --- install / remove -------------------------------------------------------------------

    def install(self) -> None:
        """Register the hooks on every module and push the counting mode."""
        for module in self.model.modules():
            self.tallies.setdefault(id(module), ModuleTally())
            ignored = isinstance(module, self._ignore_types)
            pre = self._enter_ignored if ignored else self._enter
            post = self._leave_ignored if ignored else self._leave
            self._handles.append(module.register_forward_pre_hook(pre))
            self._handles.append(module.register_forward_hook(post, always_call=True))
        self._mode = _CountingMode(self)
        self._mode.__enter__()  # type: ignore[no-untyped-call]  # torch's base is untyped

    def remove(self) -> None:
        """Pop the mode and remove every hook (the tallies are kept)."""
        if self._mode is not None:
            self._mode.__exit__(None, None, None)  # type: ignore[no-untyped-call]
            self._mode = None
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._stack, self._frames, self._ignoring = (), [], 0

    @property
    def installed(self) -> bool:
        """Whether counting is on."""
        return self._mode is not None

    def reset(self) -> None:
        """Zero every tally (hooks and mode stay as they are)."""
        self.tallies = {mid: ModuleTally() for mid in self.tallies}
        self.ops = {}
        self._segments = _Segments()

    # --- hooks ----------------------------------------------------------------------------

    def _enter(self, module: torch.nn.Module, args: Any) -> None:
        if torch._C._current_autograd_node() is not None:
            return  # recomputation inside backward: the backward's work
        mid = id(module)
        outer = self._stack
        if mid not in outer:
            self._stack = (*outer, mid)
        if self._ignoring == 0:
            self._segments.mark(self._stack)
        self._synchronize()
        self._frames.append(_Frame(mid, self._clock(), outer))

    def _leave(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if torch._C._current_autograd_node() is not None or not self._frames:
            return
        self._synchronize()
        end = self._clock()
        frame = self._frames.pop()
        tally = self.tallies[frame.module_id]
        tally.calls += 1
        if frame.module_id not in frame.outer_stack:  # not nested in a call of itself
            tally.duration_s += end - frame.start_s
        self._stack = frame.outer_stack
        if self._ignoring == 0:
            self._segments.mark(self._stack)

    def _enter_ignored(self, module: torch.nn.Module, args: Any) -> None:
        if torch._C._current_autograd_node() is None:
            self._ignoring += 1
            self._segments.mark(())

    def _leave_ignored(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if torch._C._current_autograd_node() is None and self._ignoring > 0:
            self._ignoring -= 1
            self._segments.mark(self._stack if self._ignoring == 0 else ())

    # --- counting -------------------------------------------------------------------------

    def count(self, func: Any, formula: Formula, args: Any, kwargs: Any, out: Any) -> None:
        """Attribute one operator call to the modules it ran in."""
        node = torch._C._current_autograd_node()
        backward = node is not None
        if backward:
            if not self.count_backward:
                return
            stack = self._segments.stack_of(node._sequence_nr())
        else:
            stack = () if self._ignoring else self._stack
        if not stack:
            return
        flops, macs = formula(args, kwargs, out)
        if flops == 0 and macs == 0:
            return
        tallies = self.tallies
        for mid in stack:
            tally = tallies[mid]
            if backward:
                tally.backward_flops += flops
                tally.backward_macs += macs
            else:
                tally.flops += flops
                tally.macs += macs
        per_op = self.ops.setdefault(op_name(func), [0, 0])
        per_op[1 if backward else 0] += flops


class _CountingMode(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Runs every aten operator, then hands the counted ones to the recorder."""

    def __init__(self, recorder: Recorder) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self._recorder = recorder
        self._formulas: dict[Any, Any] = {}

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        formula = self._formulas.get(func, _UNSEEN)
        if formula is _UNSEEN:
            formula = self._formulas[func] = formula_for(func)
        if formula is not None:
            self._recorder.count(func, formula, args, kwargs, out)
        return out
