"""`outside_graphs`: keep a stage-3 hook out of every graph ``torch.compile`` traces.

The gather/release hooks mutate DeepShard's own state (the fetcher's counters, the trace, which
units are gathered) and swap parameters' ``.data``. Traced by dynamo, each of those would be
baked into the graph and guarded on, so every step would see different state and recompile;
run eagerly, the compiled regions between two hooks only ever see gathered parameters, whose
shapes and strides never change, and dynamo guards on nothing the hooks touch.

``torch.compiler.disable`` would do this, but applying it imports ``torch._dynamo`` (seconds)
in every program that shards a model, compiled or not. So the wrapper calls ``fn`` directly
while ``torch._dynamo`` is not loaded (nothing can be compiling then). Once it is, the wrapper
calls ``torch.compiler.disable(fn)``, built on first use: traced, that call is where dynamo
breaks the graph and runs the hook eagerly; run eagerly from a compiled frame, it keeps dynamo
from converting the hook's own frames and everything they call (the collectives, the
fetcher). The wrapper's frame itself is marked never to be converted: it only dispatches, and
converting it would guard on its arguments and recompile for every unit.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import ParamSpec, TypeVar

import torch

__all__ = ["outside_graphs"]

_P = ParamSpec("_P")
_T = TypeVar("_T")


def outside_graphs(fn: Callable[_P, _T]) -> Callable[_P, _T]:
    """``fn``, run eagerly (with a graph break) whenever ``torch.compile`` reaches it."""
    disabled: list[Callable[_P, _T]] = []

    def eager() -> Callable[_P, _T]:
        if not disabled:
            import torch._dynamo as dynamo

            # this wrapper's own frame is never worth compiling (it only dispatches), and
            # ``fn`` with everything it calls runs with dynamo off
            dynamo.eval_frame.skip_code(run.__code__)
            disabled.append(torch.compiler.disable(fn, recursive=True))  # type: ignore[no-untyped-call]
        return disabled[0]

    def run(*args: _P.args, **kwargs: _P.kwargs) -> _T:
        # traced: dynamo breaks the graph at the disabled call and runs it eagerly; eager in
        # a program that compiles (dynamo loaded): a frame dynamo would otherwise convert
        if torch.compiler.is_compiling() or "torch._dynamo" in sys.modules:
            return eager()(*args, **kwargs)
        return fn(*args, **kwargs)

    functools.update_wrapper(run, fn)
    return run
