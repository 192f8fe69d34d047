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

What keeps it cheap (every aten operator of a step passes through the mode, a Python call each):

* Counts go to one accumulator per distinct *stack* (a Llama has a few dozen), which the hooks
  look up when the stack changes; an operator adds to that one accumulator, and the totals of
  each module (the sum over the stacks it is on) are formed only when the numbers are read.
  Integer sums in another order are the same sums, so the numbers are exactly those of adding
  to every module on the stack.
* The formula and report name of each ``OpOverload`` are resolved once; an operator without a
  formula (views, copies, ``detach``, factories...) costs one dictionary lookup.
* Counting the forward only, the mode is on the dispatch stack only while a module's forward
  runs (pushed when the stack becomes non-empty, popped when it empties): operators outside
  the model, the backward among them, then run at full speed — nothing there would count.

Built with ``counting=False`` (replay counting, `deepshard.profiler._replay`), the recorder
only times the modules and hands each outermost call that returned to ``on_call``; the mode is
never pushed, so the profiled step pays the hooks alone.

Nothing global is modified: the mode is pushed on the thread's mode stack and popped, the
hooks are removed by handle, and no attribute is set on a module or tensor.
"""

from __future__ import annotations

import bisect
import contextlib
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.hooks import RemovableHandle

from deepshard.profiler._formulas import Formula, formula_for, op_name

__all__ = ["ModuleTally", "Recorder"]

Stack = tuple[int, ...]
"""``id``s of the modules whose forward is running, outermost first, each once."""


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


@dataclass(frozen=True)
class _Counted:
    """How one ``OpOverload`` is counted, resolved at its first call."""

    formula: Formula
    name: str
    """The operator name it is reported under (``add`` for ``add_.Tensor``)."""


@dataclass
class _Frame:
    module_id: int
    start_s: float
    outer_stack: Stack
    call: tuple[Any, Any] | None = None
    """``(args, kwargs)`` of an outermost call, kept until it returns (when calls are recorded)."""


@dataclass
class _Segments:
    """Autograd sequence numbers at which the module stack changed, and the backward
    accumulator (``[flops, macs]``) of the stack from there (None: nothing counts)."""

    starts: list[int] = field(default_factory=list)
    counters: list[list[int] | None] = field(default_factory=list)

    def mark(self, counter: list[int] | None) -> None:
        seq = torch._C._autograd._get_sequence_nr()
        if self.starts and self.starts[-1] == seq:
            self.counters[-1] = counter  # no node was recorded under the previous stack
        else:
            self.starts.append(seq)
            self.counters.append(counter)

    def counter_of(self, seq: int) -> list[int] | None:
        index = bisect.bisect_right(self.starts, seq) - 1
        return self.counters[index] if index >= 0 else None


@dataclass
class _Counts:
    """``[flops, macs]`` accumulators per stack, forward and backward, and per operator."""

    forward: dict[Stack, list[int]] = field(default_factory=dict)
    backward: dict[Stack, list[int]] = field(default_factory=dict)
    ops: dict[str, list[int]] = field(default_factory=dict)
    """``[forward FLOPs, backward FLOPs]`` per operator name (only operators that counted)."""
    segments: _Segments = field(default_factory=_Segments)


class Recorder:
    """Counts operators into per-module tallies while its hooks and mode are installed.

    Args:
        model: The model whose modules are tracked.
        ignore_types: Module types whose forward (and backward) is not counted at all.
        count_backward: Also count the backward operators of nodes the model's forward recorded.
        synchronize: Waits for queued device work before each clock reading.
        clock: Monotonic seconds.
        counting: Count operators (the dispatch mode); False times the modules only.
        on_call: Given ``(module, args, kwargs)`` of each outermost call that returned (not
            one that raised): the replay records the calls it counts later.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        ignore_types: tuple[type, ...],
        count_backward: bool,
        synchronize: Callable[[], None],
        clock: Callable[[], float] = time.perf_counter,
        counting: bool = True,
        on_call: Callable[[torch.nn.Module, Any, Any], None] | None = None,
    ) -> None:
        self.model = model
        self.count_backward = count_backward and counting
        self._counting = counting
        self._on_call = on_call
        self._ignore_types = ignore_types
        self._synchronize = synchronize
        self._clock = clock
        self._timings: dict[int, ModuleTally] = {}  # calls and duration only
        self._counts = _Counts()
        self._stack: Stack = ()
        self._current: list[int] | None = None  # forward accumulator; None: nothing counts
        self._frames: list[_Frame] = []
        self._ignoring = 0
        self._handles: list[RemovableHandle] = []
        self._mode = _CountingMode(self)
        self._mode_on = False
        self._installed = False

    # --- install / remove -------------------------------------------------------------------

    def install(self) -> None:
        """Register the hooks on every module (and, counting backward, push the mode)."""
        self._add_hooks()
        self._installed = True
        if self.count_backward:
            self._push_mode()

    def _add_hooks(self) -> None:
        # The hooks are bookkeeping that must run as written (they push the mode, read clocks):
        # a compiled model graph-breaks around them rather than tracing them.
        enter, leave = _eager(self._enter), _eager(self._leave)
        enter_ignored, leave_ignored = _eager(self._enter_ignored), _eager(self._leave_ignored)
        for module in self.model.modules():
            self._timings.setdefault(id(module), ModuleTally())
            ignored = isinstance(module, self._ignore_types)
            pre = enter_ignored if ignored else enter
            post = leave_ignored if ignored else leave
            self._handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
            self._handles.append(module.register_forward_hook(post, always_call=True))

    @contextlib.contextmanager
    def suspended(self) -> Iterator[None]:
        """Without this recorder's hooks inside the block (a replay of the model runs there);
        the stack, frames and tallies are kept."""
        if not self._installed or self._mode_on:
            yield  # a counting recorder with its mode on is never suspended: nothing to do
            return
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        try:
            yield
        finally:
            self._add_hooks()

    def remove(self) -> None:
        """Pop the mode and remove every hook (the tallies are kept)."""
        self._pop_mode()
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._stack, self._frames, self._ignoring, self._current = (), [], 0, None
        self._installed = False

    @property
    def installed(self) -> bool:
        """Whether counting is on."""
        return self._installed

    def reset(self) -> None:
        """Zero every tally (hooks and mode stay as they are)."""
        self._timings = {mid: ModuleTally() for mid in self._timings}
        self._counts = _Counts()
        self._current = self._forward_counter()

    def _push_mode(self) -> None:
        if not self._mode_on:
            self._mode.__enter__()  # type: ignore[no-untyped-call]  # torch's base is untyped
            self._mode_on = True

    def _pop_mode(self) -> None:
        if self._mode_on:
            self._mode.__exit__(None, None, None)  # type: ignore[no-untyped-call]
            self._mode_on = False

    # --- numbers ----------------------------------------------------------------------------

    @property
    def tallies(self) -> dict[int, ModuleTally]:
        """Per module object (by ``id``): its calls, duration and the sums of its stacks."""
        tallies = {
            mid: ModuleTally(duration_s=t.duration_s, calls=t.calls)
            for mid, t in self._timings.items()
        }
        for stack, (flops, macs) in self._counts.forward.items():
            for mid in stack:
                tallies[mid].flops += flops
                tallies[mid].macs += macs
        for stack, (flops, macs) in self._counts.backward.items():
            for mid in stack:
                tallies[mid].backward_flops += flops
                tallies[mid].backward_macs += macs
        return tallies

    @property
    def ops(self) -> dict[str, list[int]]:
        """``[forward FLOPs, backward FLOPs]`` per operator name that counted any."""
        return self._counts.ops

    # --- hooks ----------------------------------------------------------------------------

    def _forward_counter(self) -> list[int] | None:
        if self._ignoring or not self._stack:
            return None
        return self._counts.forward.setdefault(self._stack, [0, 0])

    def _set_stack(self, stack: Stack) -> None:
        """Make ``stack`` current: its accumulators, a segment, the mode when forward-only."""
        self._stack = stack
        if not self._counting:
            return
        if self._ignoring == 0:
            self._current = self._forward_counter()
            self._mark(stack)
        if not self.count_backward:
            if stack:
                self._push_mode()
            else:
                self._pop_mode()

    def _mark(self, stack: Stack) -> None:
        """Start a segment for ``stack`` (empty: nothing counts); only backward reads them."""
        if self.count_backward:
            backward = self._counts.backward.setdefault(stack, [0, 0]) if stack else None
            self._counts.segments.mark(backward)

    def _enter(self, module: torch.nn.Module, args: Any, kwargs: Any) -> None:
        if torch._C._current_autograd_node() is not None:
            return  # recomputation inside backward: the backward's work
        mid = id(module)
        outer = self._stack
        recorded = self._on_call is not None and not outer and not self._ignoring
        call = (args, kwargs) if recorded else None
        self._set_stack(outer if mid in outer else (*outer, mid))
        self._synchronize()
        self._frames.append(_Frame(mid, self._clock(), outer, call))

    def _leave(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if torch._C._current_autograd_node() is not None or not self._frames:
            return
        self._synchronize()
        end = self._clock()
        frame = self._frames.pop()
        timing = self._timings[frame.module_id]
        timing.calls += 1
        if frame.module_id not in frame.outer_stack:  # not nested in a call of itself
            timing.duration_s += end - frame.start_s
        self._set_stack(frame.outer_stack)
        # The hook runs inside torch's `except` when the forward raised (always_call).
        raised = output is None and sys.exc_info()[0] is not None
        if frame.call is not None and self._on_call is not None and not raised:
            self._on_call(module, *frame.call)

    def _enter_ignored(self, module: torch.nn.Module, args: Any, kwargs: Any) -> None:
        if torch._C._current_autograd_node() is None:
            self._ignoring += 1
            self._current = None
            self._mark(())

    def _leave_ignored(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if torch._C._current_autograd_node() is None and self._ignoring > 0:
            self._ignoring -= 1
            if self._ignoring == 0:
                self._set_stack(self._stack)
            else:
                self._mark(())

    # --- counting -------------------------------------------------------------------------

    def count(self, counted: _Counted, args: Any, kwargs: Any, out: Any) -> None:
        """Attribute one operator call to the stack it ran under."""
        # None outside backward (torch's stub says it always returns a node).
        node: torch.autograd.graph.Node | None = torch._C._current_autograd_node()
        if node is None:
            counter = self._current
        elif self.count_backward:
            counter = self._counts.segments.counter_of(node._sequence_nr())
        else:
            return
        if counter is None:
            return
        flops, macs = counted.formula(args, kwargs, out)
        if flops == 0 and macs == 0:
            return
        counter[0] += flops
        counter[1] += macs
        per_op = self._counts.ops.get(counted.name)
        if per_op is None:
            per_op = self._counts.ops[counted.name] = [0, 0]
        per_op[node is not None] += flops


class _CountingMode(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Runs every aten operator, then hands the counted ones to the recorder."""

    def __init__(self, recorder: Recorder) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self._count = recorder.count
        # By `id`: an `OpOverload` hashes in Python, a lookup per operator would cost a call.
        # The overload is kept in the value, so its `id` is not reused while it is a key.
        self._counted: dict[int, tuple[Any, _Counted | None]] = {}

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        entry = self._counted.get(id(func))
        if entry is None:
            entry = self._counted[id(func)] = (func, _resolve(func))
        if entry[1] is not None:
            self._count(entry[1], args, kwargs, out)
        return out


def _eager(hook: Callable[..., None]) -> Callable[..., None]:
    """``hook`` run eagerly even inside a compiled model (``torch.compiler.disable``)."""
    eager: Callable[..., None] = torch.compiler.disable(hook)  # type: ignore[no-untyped-call]
    return eager


def _resolve(func: Any) -> _Counted | None:
    formula = formula_for(func)
    return None if formula is None else _Counted(formula, op_name(func))
